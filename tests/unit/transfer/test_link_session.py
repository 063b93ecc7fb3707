"""Checkpoint replication links, both ends, sans-I/O: frames go through the real codec.

The claims: no Put before the holder proved membership and a compatible engine; every Put is
bound to its link (a recorded link replayed to a holder fails at its first Put), its fields and
its data; a refused Put leaves the link usable, any other failure leaves it FAILED.
"""

from __future__ import annotations

import dataclasses

import pytest
from frame_decoder import FrameDecoder
from fuzz_support import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from pdserve.errors import (
    CheckpointRefused,
    FingerprintMismatch,
    IllegalTransition,
    PdserveError,
    ProtocolError,
    TransferRefused,
    Unauthenticated,
)
from pdserve.transfer.codec import Envelope, Frame, data_checksum, encode
from pdserve.transfer.link_session import LinkHolder, LinkState, LinkWriter
from pdserve.transfer.messages import MAX_PUT_TOKENS, Ack, AckOf, NackCode, Put, Role
from pdserve.transfer.session import Outbound

FP: dict[str, str | int | float | bool] = {"model": "tiny", "dtype": "float32", "block_size": 4}
KEY = b"k" * 32
DATA = bytes(range(64))
PUT = Put("req-1", 0, 4, (1, 2, 3, 4), 30.0, b"digest")


def wire(out: Outbound, data: bytes = b"") -> bytes:
    return b"".join(bytes(p) for p in encode(out.message, data or None, envelope=out.envelope))


def through(out: Outbound, data: bytes = b"") -> Frame:
    frames = FrameDecoder().feed(wire(out, data))
    assert len(frames) == 1
    return frames[0]


def opened(key: bytes | None = KEY) -> tuple[LinkWriter, LinkHolder]:
    writer, holder = LinkWriter(FP, key), LinkHolder(FP, key, Role.DECODE)
    hello = through(writer.hello())
    reply, error = holder.accept(hello.header, hello.message)  # type: ignore[arg-type]
    assert error is None
    answer = through(reply)
    writer.receive_hello(answer.header, answer.message)
    assert writer.state is LinkState.READY and holder.state is LinkState.READY
    return writer, holder


def put_once(writer: LinkWriter, holder: LinkHolder, put: Put = PUT, data: bytes = DATA) -> None:
    frame = through(writer.put(put, data_checksum([data])), data)
    assert isinstance(frame.message, Put)
    holder.check_put(frame.header, frame.message)
    ack = through(holder.ack())
    writer.receive_reply(ack.header, ack.message)


@pytest.mark.parametrize("key", [KEY, None])
def test_a_link_carries_put_after_put_each_answered_in_order(key: bytes | None) -> None:
    writer, holder = opened(key)
    for i in range(5):
        put_once(writer, holder, Put("req-1", i, 4 * (i + 1), (i,) * 4, 30.0), DATA[i:])
    assert writer.num_owed == 0
    # Several Puts in flight: the replies come back in order.
    frames = [through(writer.put(PUT, data_checksum([DATA])), DATA) for _ in range(3)]
    assert writer.num_owed == 3
    for frame in frames:
        assert isinstance(frame.message, Put)
        holder.check_put(frame.header, frame.message)
    for _ in frames:
        ack = through(holder.ack())
        writer.receive_reply(ack.header, ack.message)
    assert writer.num_owed == 0


def test_a_refused_put_raises_checkpoint_refused_and_the_link_goes_on() -> None:
    writer, holder = opened()
    frame = through(writer.put(PUT, data_checksum([DATA])), DATA)
    holder.check_put(frame.header, frame.message)  # type: ignore[arg-type]
    nack = through(holder.nack(NackCode.CHECKPOINT_REFUSED, "chain: parent not held"))
    with pytest.raises(CheckpointRefused, match="parent not held"):
        writer.receive_reply(nack.header, nack.message)
    assert writer.state is LinkState.READY
    put_once(writer, holder)


def test_any_other_nack_fails_the_link() -> None:
    writer, holder = opened()
    through(writer.put(PUT, data_checksum([DATA])), DATA)
    nack = through(holder.nack(NackCode.CHECKSUM_MISMATCH, "data checksum"))
    with pytest.raises(TransferRefused, match="CHECKSUM_MISMATCH"):
        writer.receive_reply(nack.header, nack.message)
    assert writer.state is LinkState.FAILED
    with pytest.raises(IllegalTransition):
        writer.put(PUT, 0)


def test_no_put_before_the_holder_answered() -> None:
    writer = LinkWriter(FP, KEY)
    with pytest.raises(IllegalTransition):
        writer.put(PUT, 0)
    writer.hello()
    with pytest.raises(IllegalTransition):
        writer.put(PUT, 0)


@pytest.mark.parametrize(("writer_key", "holder_key"), [(KEY, b"x" * 32), (None, KEY), (KEY, None)])
def test_a_holder_or_writer_outside_the_cluster_is_refused(
    writer_key: bytes | None, holder_key: bytes | None
) -> None:
    writer, holder = LinkWriter(FP, writer_key), LinkHolder(FP, holder_key, Role.DECODE)
    hello = through(writer.hello())
    reply, error = holder.accept(hello.header, hello.message)  # type: ignore[arg-type]
    answer = through(reply)
    if holder_key is not None:
        # The holder checks the writer's MAC first and answers with a Nack.
        assert isinstance(error, Unauthenticated)
        with pytest.raises(TransferRefused, match="UNAUTHENTICATED"):
            writer.receive_hello(answer.header, answer.message)
    else:
        # A holder without the secret checks nothing, and the writer refuses its unsigned Hello.
        assert error is None
        with pytest.raises(Unauthenticated):
            writer.receive_hello(answer.header, answer.message)
    assert writer.state is LinkState.FAILED


def test_a_holder_of_another_engine_refuses_the_link_naming_the_field() -> None:
    writer, holder = LinkWriter(FP, KEY), LinkHolder({**FP, "dtype": "bf16"}, KEY, Role.DECODE)
    hello = through(writer.hello())
    reply, error = holder.accept(hello.header, hello.message)  # type: ignore[arg-type]
    assert isinstance(error, FingerprintMismatch) and "dtype" in str(error)
    answer = through(reply)
    with pytest.raises(TransferRefused, match="FINGERPRINT_MISMATCH"):
        writer.receive_hello(answer.header, answer.message)


def test_the_writer_refuses_a_holder_of_another_engine_itself() -> None:
    """A holder that would take anything (an old or buggy build) still gets no Put."""
    writer = LinkWriter(FP, KEY)
    holder = LinkHolder({**FP, "block_size": 8}, KEY, Role.DECODE, compare=lambda a, b: {})
    hello = through(writer.hello())
    reply, error = holder.accept(hello.header, hello.message)  # type: ignore[arg-type]
    assert error is None
    answer = through(reply)
    with pytest.raises(FingerprintMismatch, match="block_size"):
        writer.receive_hello(answer.header, answer.message)


def test_a_recorded_link_replayed_to_a_holder_fails_at_its_first_put() -> None:
    writer, holder = LinkWriter(FP, KEY), LinkHolder(FP, KEY, Role.DECODE)
    hello_bytes = wire(writer.hello())
    (hello,) = FrameDecoder().feed(hello_bytes)
    reply, _ = holder.accept(hello.header, hello.message)  # type: ignore[arg-type]
    answer = through(reply)
    writer.receive_hello(answer.header, answer.message)
    put_bytes = wire(writer.put(PUT, data_checksum([DATA])), DATA)
    # An attacker replays the writer's frames to the holder on a new connection.
    fresh = LinkHolder(FP, KEY, Role.DECODE)
    (hello,) = FrameDecoder().feed(hello_bytes)
    _, error = fresh.accept(hello.header, hello.message)  # type: ignore[arg-type]
    assert error is None  # a Hello alone proves nothing
    (put,) = FrameDecoder().feed(put_bytes)
    with pytest.raises(Unauthenticated, match="MAC"):
        fresh.check_put(put.header, put.message)  # type: ignore[arg-type]
    assert fresh.state is LinkState.FAILED


@pytest.mark.parametrize(
    "change",
    [
        {"owner": "req-2"},
        {"parent_hash": 7},
        {"first_version": 8},
        {"token_ids": (1, 2, 3, 5)},
        {"lease_ttl": 3600.0},
        {"value_digest": b"other"},
    ],
)
def test_a_put_altered_in_flight_fails_its_mac(change: dict[str, object]) -> None:
    writer, holder = opened()
    frame = through(writer.put(PUT, data_checksum([DATA])), DATA)
    assert isinstance(frame.message, Put)
    forged = dataclasses.replace(frame.message, **change)  # type: ignore[arg-type]
    with pytest.raises(Unauthenticated):
        holder.check_put(frame.header, forged)


def test_a_put_whose_data_was_swapped_fails_its_mac() -> None:
    writer, holder = opened()
    signed = writer.put(PUT, data_checksum([DATA]))
    other = bytes(reversed(DATA))
    frame = through(Outbound(signed.envelope, signed.message), other)
    with pytest.raises(Unauthenticated):
        holder.check_put(frame.header, frame.message)  # type: ignore[arg-type]


def test_frames_out_of_sequence_fail_the_link() -> None:
    writer, holder = opened()
    writer.put(PUT, data_checksum([DATA]))  # seq 1 never arrives
    frame = through(writer.put(PUT, data_checksum([DATA])), DATA)
    with pytest.raises(ProtocolError, match="seq"):
        holder.check_put(frame.header, frame.message)  # type: ignore[arg-type]
    assert holder.state is LinkState.FAILED


def test_a_reply_to_no_put_fails_the_writer() -> None:
    writer, holder = opened()
    ack = through(holder.ack())
    with pytest.raises(ProtocolError, match="no Put"):
        writer.receive_reply(ack.header, ack.message)


def test_an_ack_of_something_else_is_not_an_answer_to_a_put() -> None:
    writer, _ = opened()
    writer.put(PUT, data_checksum([DATA]))
    wrong = through(Outbound(Envelope(bytes(16), 1, 1), Ack(AckOf.COMMIT)))
    with pytest.raises(ProtocolError, match="answers a Put"):
        writer.receive_reply(wrong.header, wrong.message)


def test_put_bounds_are_checked_on_encode() -> None:
    writer, _ = opened()
    too_many = Put("req-1", 0, 4, (1,) * (MAX_PUT_TOKENS + 1), 30.0)
    with pytest.raises(ValueError, match="items"):
        wire(writer.put(too_many, 0), DATA)
    with pytest.raises(ValueError, match="needs its data"):
        wire(writer.put(PUT, 0))


@fuzz_settings(200)
@given(st.data())
def test_any_byte_flipped_in_a_put_frame_is_caught(data: st.DataObject) -> None:
    """Header, body or data: the codec's checksums or the Put's MAC refuse the frame."""
    writer, holder = opened()
    raw = bytearray(wire(writer.put(PUT, data_checksum([DATA])), DATA))
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] ^= data.draw(st.integers(1, 255))
    try:
        frames = FrameDecoder().feed(bytes(raw))
        if not frames:
            return  # a length grew: the decoder waits for bytes that never come (a timeout)
        (frame,) = frames
        if frame.data != DATA:
            # The I/O layer checks landed data against the header's checksum.
            assert data_checksum([frame.data]) != frame.header.data_checksum
            return
        holder.check_put(frame.header, frame.message)  # type: ignore[arg-type]
    except PdserveError:
        return
    raise AssertionError(f"byte {i} flipped and nothing noticed")
