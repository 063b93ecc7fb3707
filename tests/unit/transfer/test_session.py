"""Sender and receiver sessions: tables, every check the receiver makes, retries, fencing.

Frames travel through the real codec (`encode` → `FrameDecoder`) between the two sessions.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from frame_decoder import FrameDecoder

from pdserve.clock import FakeClock
from pdserve.errors import (
    ChecksumMismatch,
    FingerprintMismatch,
    IllegalTransition,
    LeaseExpired,
    ProtocolError,
    StaleAttempt,
    TransferRefused,
    Unauthorized,
    UnsupportedVersion,
)
from pdserve.transfer.codec import Envelope, Frame, data_checksum, encode
from pdserve.transfer.lease import LeaseTable
from pdserve.transfer.messages import (
    PROTOCOL_VERSION,
    Abort,
    Ack,
    AckOf,
    Begin,
    Chunk,
    Commit,
    Hello,
    KVLayout,
    Message,
    Nack,
    NackCode,
    Renew,
    Role,
    commit_digest,
    token_digest,
)
from pdserve.transfer.receiver_session import (
    RECEIVER_TRANSITIONS,
    ReceivePlan,
    ReceiverEvent,
    ReceiverSession,
    ReceiverState,
)
from pdserve.transfer.sender_session import (
    SENDER_TRANSITIONS,
    SenderAction,
    SenderEvent,
    SenderSession,
    SenderState,
)
from pdserve.transfer.session import Outbound, fingerprint_diff, transition

FP: dict[str, str | int | float | bool] = {"model": "tiny", "dtype": "bf16", "block_size": 16}
LAYOUT = KVLayout(num_layers=2, num_blocks=4, block_bytes=64, dtype="bf16", block_size=16)
TID = bytes(range(16))
TOKEN = b"capability-token"
PROMPT = list(range(50))
BLOCKS = [bytes([i + 1]) * LAYOUT.block_bytes for i in range(LAYOUT.num_blocks)]


def make_plan() -> ReceivePlan:
    return ReceivePlan(TID, TOKEN, LAYOUT, "req-1", len(PROMPT), token_digest(PROMPT))


def make_begin(**changes: object) -> Begin:
    fields: dict[str, object] = dict(
        transfer_id=TID,
        request_id="req-1",
        snapshot_version=1,
        layout=LAYOUT,
        num_tokens=len(PROMPT),
        token_digest=token_digest(PROMPT),
        capability_token=TOKEN,
    )
    fields.update(changes)
    return Begin(**fields)  # type: ignore[arg-type]


def chunk_of(first: int, num: int) -> tuple[Chunk, bytes]:
    """Blocks [first, first + num) as one chunk (a byte range of the payload)."""
    data = b"".join(BLOCKS[first : first + num])
    bb = LAYOUT.block_bytes
    return Chunk(first * bb, max(num, 1) * bb, data_checksum([data])), data


def through_wire(out: Outbound, data: bytes = b"") -> Frame:
    parts = encode(out.message, data or None, envelope=out.envelope)
    frames = FrameDecoder().feed(b"".join(bytes(p) for p in parts))
    assert len(frames) == 1
    return frames[0]


def raw(attempt: int, seq: int, message: Message) -> Outbound:
    return Outbound(Envelope(TID, attempt, seq), message)


class Link:
    """A sender and a receiver session joined through the codec."""

    def __init__(self, receiver: ReceiverSession | None = None) -> None:
        self.sender = SenderSession(TID, FP)
        self.receiver = receiver or ReceiverSession(make_plan(), FP)

    def to_receiver(self, out: Outbound, data: bytes = b"") -> list[Outbound]:
        frame = through_wire(out, data)
        replies = self.receiver.receive(frame.header, frame.message)
        if frame.data:  # the I/O layer landed the data; it reports the checksum it saw
            replies += self.receiver.data_received(data_checksum([frame.data]))
        return replies

    def to_sender(self, replies: list[Outbound]) -> list[SenderAction]:
        actions = []
        for reply in replies:
            frame = through_wire(reply)
            actions.append(self.sender.receive(frame.header, frame.message))
        return actions

    def exchange(self, out: Outbound, data: bytes = b"") -> list[SenderAction]:
        return self.to_sender(self.to_receiver(out, data))

    def open(self, begin: Begin | None = None) -> None:
        """Handshake and Begin, ready to send chunks."""
        assert self.exchange(self.sender.send_hello()) == [SenderAction.SEND_BEGIN]
        assert self.exchange(self.sender.send_begin(begin or make_begin())) == [
            SenderAction.SEND_CHUNKS
        ]

    def send_all(self, sizes: tuple[int, ...] = (2, 1, 1)) -> None:
        first = 0
        for num in sizes:
            chunk, data = chunk_of(first, num)
            assert self.exchange(self.sender.send_chunk(chunk), data) == []
            first += num


# ---- the happy path ----------------------------------------------------------------------------


def test_a_whole_transfer_commits_and_only_then_releases_the_lease() -> None:
    link = Link()
    s, r = link.sender, link.receiver
    assert (s.state, r.state) == (SenderState.IDLE, ReceiverState.IDLE)
    assert link.exchange(s.send_hello()) == [SenderAction.SEND_BEGIN]
    assert (s.state, r.state) == (SenderState.READY, ReceiverState.HANDSHAKEN)
    assert link.exchange(s.send_begin(make_begin())) == [SenderAction.SEND_CHUNKS]
    assert (s.state, r.state) == (SenderState.SENDING, ReceiverState.RECEIVING)
    link.send_all()
    assert not s.lease_releasable and not r.verified
    commit = s.send_commit()
    assert commit.message == Commit(
        commit_digest([chunk_of(0, 2)[0], chunk_of(2, 1)[0], chunk_of(3, 1)[0]]), 3, 256
    )
    replies = link.to_receiver(commit)
    assert [o.message for o in replies] == [Ack(AckOf.COMMIT)]
    assert r.verified and r.state is ReceiverState.COMMITTED
    assert not s.lease_releasable  # the Ack has not arrived yet
    assert link.to_sender(replies) == [SenderAction.RELEASE_LEASE]
    assert s.state is SenderState.DONE and s.lease_releasable


def test_chunks_may_arrive_in_any_block_order() -> None:
    link = Link()
    link.open()
    for first in (3, 0, 2, 1):
        chunk, data = chunk_of(first, 1)
        link.exchange(link.sender.send_chunk(chunk), data)
    assert link.exchange(link.sender.send_commit()) == [SenderAction.RELEASE_LEASE]
    assert link.receiver.verified


def test_the_receiver_tells_where_a_pending_chunk_goes() -> None:
    link = Link()
    link.open()
    chunk, data = chunk_of(1, 2)
    frame = through_wire(link.sender.send_chunk(chunk), data)
    assert link.receiver.receive(frame.header, frame.message) == []
    assert link.receiver.pending_chunk == chunk
    assert link.receiver.state is ReceiverState.CHUNK_PENDING
    link.receiver.data_received(data_checksum([data[:10], data[10:]]))
    assert link.receiver.pending_chunk is None


# ---- handshake ---------------------------------------------------------------------------------


def test_fingerprint_mismatch_is_refused_naming_every_differing_field() -> None:
    link = Link(ReceiverSession(make_plan(), {**FP, "dtype": "fp16", "extra": 1}))
    with pytest.raises(FingerprintMismatch) as caught:
        link.to_receiver(link.sender.send_hello())
    assert caught.value.fields == {"dtype": ("fp16", "bf16"), "extra": (1, None)}
    assert link.receiver.state is ReceiverState.FAILED
    (nack,) = link.receiver.take_outgoing()
    assert isinstance(nack.message, Nack)
    assert nack.message.code is NackCode.FINGERPRINT_MISMATCH and not nack.message.retryable
    assert "dtype: 'fp16' != 'bf16'" in nack.message.text and "extra" in nack.message.text
    with pytest.raises(TransferRefused) as refused:
        link.to_sender([nack])
    assert not refused.value.retryable and "FINGERPRINT_MISMATCH" in refused.value.reason
    assert link.sender.state is SenderState.FAILED and not link.sender.lease_releasable


def test_a_custom_fingerprint_comparison_decides() -> None:
    def ignore_model(
        a: dict[str, object], b: dict[str, object]
    ) -> dict[str, tuple[object, object]]:
        return {k: v for k, v in fingerprint_diff(a, b).items() if k != "model"}  # type: ignore[arg-type]

    receiver = ReceiverSession(make_plan(), {**FP, "model": "other"}, compare=ignore_model)  # type: ignore[arg-type]
    link = Link(receiver)
    link.sender = SenderSession(TID, FP, compare=ignore_model)  # type: ignore[arg-type]
    link.open()
    assert receiver.state is ReceiverState.RECEIVING


def test_bool_and_int_fingerprint_values_differ() -> None:
    assert fingerprint_diff({"a": True}, {"a": 1}) == {"a": (True, 1)}
    assert fingerprint_diff({"a": 1.0}, {"a": 1.0}) == {}


def test_the_sender_also_checks_the_receivers_hello() -> None:
    link = Link()
    link.sender.send_hello()
    reply = raw(1, 0, Hello(PROTOCOL_VERSION, Role.DECODE, {**FP, "block_size": 32}))
    with pytest.raises(FingerprintMismatch):
        link.to_sender([reply])
    assert link.sender.state is SenderState.FAILED
    link.sender.restart()
    link.sender.send_hello()
    with pytest.raises(UnsupportedVersion):
        link.to_sender([raw(2, 0, Hello(PROTOCOL_VERSION + 1, Role.DECODE, FP))])


def test_an_other_protocol_version_in_hello_is_refused() -> None:
    link = Link()
    with pytest.raises(UnsupportedVersion):
        link.to_receiver(raw(1, 0, Hello(PROTOCOL_VERSION + 1, Role.PREFILL, FP)))
    (nack,) = link.receiver.take_outgoing()
    assert isinstance(nack.message, Nack) and nack.message.code is NackCode.VERSION_MISMATCH


# ---- Begin -------------------------------------------------------------------------------------


def test_a_wrong_capability_token_is_unauthorized_and_nothing_is_accepted() -> None:
    link = Link()
    link.exchange(link.sender.send_hello())
    with pytest.raises(Unauthorized):
        link.to_receiver(link.sender.send_begin(make_begin(capability_token=b"x" * 16)))
    (nack,) = link.receiver.take_outgoing()
    assert isinstance(nack.message, Nack) and nack.message.code is NackCode.UNAUTHORIZED
    assert "req-1" not in nack.message.text  # nothing about the plan leaks
    assert link.receiver.state is ReceiverState.FAILED and link.receiver.begin is None
    chunk, data = chunk_of(0, 1)
    with pytest.raises(IllegalTransition):
        link.to_receiver(raw(1, 2, chunk), data)


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"layout": KVLayout(2, 4, 64, "fp16", 16)}, "layout"),
        ({"layout": KVLayout(2, 5, 64, "bf16", 16)}, "layout"),
        ({"request_id": "req-2"}, "request_id"),
        ({"num_tokens": 49}, "num_tokens"),
        ({"token_digest": token_digest([1])}, "token_digest"),
        ({"transfer_id": bytes(16)}, "transfer_id"),
    ],
)
def test_a_begin_that_does_not_match_the_reservation_is_refused(
    changes: dict[str, object], field: str
) -> None:
    link = Link()
    link.exchange(link.sender.send_hello())
    begin = make_begin(**changes)
    with pytest.raises(ProtocolError, match=field):
        link.to_receiver(raw(1, 1, begin))
    (nack,) = link.receiver.take_outgoing()
    assert isinstance(nack.message, Nack) and nack.message.code is NackCode.BEGIN_MISMATCH
    assert field in nack.message.text


# ---- chunks and commit -------------------------------------------------------------------------


def opened() -> Link:
    link = Link()
    link.open()
    return link


def refused_with(link: Link, code: NackCode) -> None:
    (nack,) = link.receiver.take_outgoing()
    assert isinstance(nack.message, Nack) and nack.message.code is code
    assert link.receiver.state is ReceiverState.FAILED and not link.receiver.verified


def test_corrupt_chunk_data_fails_the_attempt() -> None:
    link = opened()
    chunk, data = chunk_of(0, 2)
    frame = through_wire(link.sender.send_chunk(chunk), data)
    link.receiver.receive(frame.header, frame.message)
    with pytest.raises(ChecksumMismatch):
        link.receiver.data_received(data_checksum([b"\0" + data[1:]]))
    refused_with(link, NackCode.CHECKSUM_MISMATCH)


BB = LAYOUT.block_bytes


@pytest.mark.parametrize(
    "chunks,bad,code",
    [
        # (offset, num_bytes) of the bad chunk, in bytes of the payload (4 blocks of 64).
        ([], (3 * BB, 2 * BB), NackCode.CHUNK_OUT_OF_RANGE),
        ([], (4 * BB, BB), NackCode.CHUNK_OUT_OF_RANGE),
        ([], (4 * BB - 1, 2), NackCode.CHUNK_OUT_OF_RANGE),  # one byte past the end
        ([(0, 2)], (0, 2 * BB), NackCode.CHUNK_OVERLAP),  # a duplicate
        ([(0, 2)], (BB, BB), NackCode.CHUNK_OVERLAP),
        ([(2, 2)], (BB, 2 * BB), NackCode.CHUNK_OVERLAP),
        ([(1, 1)], (0, 3 * BB), NackCode.CHUNK_OVERLAP),
        ([(1, 1)], (2 * BB - 1, 2), NackCode.CHUNK_OVERLAP),  # one byte into a chunk
    ],
)
def test_chunks_out_of_range_or_overlapping_are_refused(
    chunks: list[tuple[int, int]], bad: tuple[int, int], code: NackCode
) -> None:
    link = opened()
    for first, num in chunks:
        chunk, data = chunk_of(first, num)
        link.exchange(link.sender.send_chunk(chunk), data)
    offset, num_bytes = bad
    data = b"\5" * num_bytes
    bad_chunk = Chunk(offset, num_bytes, data_checksum([data]))
    with pytest.raises(ValueError):
        link.sender.send_chunk(bad_chunk)  # the sender refuses to build it, too
    with pytest.raises(ProtocolError):
        link.to_receiver(raw(1, 2 + len(chunks), bad_chunk), data)
    refused_with(link, code)


def test_a_block_may_travel_in_pieces_and_pieces_may_span_blocks() -> None:
    # Byte ranges that cut blocks anywhere, out of order: the transfer still commits.
    link = opened()
    payload = b"".join(BLOCKS)
    cuts = [(100, 70), (0, 100), (170, 86)]  # [100,170) [0,100) [170,256)
    for offset, num in cuts:
        data = payload[offset : offset + num]
        chunk = Chunk(offset, num, data_checksum([data]))
        assert link.exchange(link.sender.send_chunk(chunk), data) == []
    assert link.exchange(link.sender.send_commit()) == [SenderAction.RELEASE_LEASE]
    assert link.receiver.verified


def test_a_chunk_whose_data_length_disagrees_with_its_blocks_is_refused() -> None:
    link = opened()
    data = BLOCKS[0] + b"\0"
    with pytest.raises(ProtocolError, match="data_len"):
        link.to_receiver(raw(1, 2, Chunk(0, BB, data_checksum([data]))), data)
    refused_with(link, NackCode.CHUNK_OUT_OF_RANGE)


@pytest.mark.parametrize(
    "commit,error",
    [
        (Commit(0, 2, 192), ProtocolError),  # counts of what was received, but incomplete
        (Commit(0, 3, 256), ProtocolError),  # claims more than was received
    ],
)
def test_an_incomplete_transfer_never_commits(commit: Commit, error: type) -> None:
    link = opened()
    link.send_all((2, 1))
    with pytest.raises(error):
        link.to_receiver(raw(1, 4, commit))
    refused_with(link, NackCode.COMMIT_MISMATCH)


def test_a_commit_with_the_wrong_digest_or_counts_is_refused() -> None:
    for commit, error in [
        (Commit(12345, 3, 256), ChecksumMismatch),
        (Commit(0, 4, 256), ProtocolError),
        (Commit(0, 3, 255), ProtocolError),
    ]:
        link = opened()
        link.send_all()
        good = link.sender.send_commit().message
        assert isinstance(good, Commit)
        if error is ChecksumMismatch:
            assert commit.total_digest != good.total_digest
        else:
            commit = Commit(good.total_digest, commit.num_chunks, commit.num_bytes)
        with pytest.raises(error):
            link.to_receiver(raw(1, 5, commit))
        refused_with(link, NackCode.COMMIT_MISMATCH)
        with pytest.raises(TransferRefused) as refused:
            link.to_sender([raw(1, 2, Nack(NackCode.COMMIT_MISMATCH, "x", True))])
        assert refused.value.retryable and not link.sender.lease_releasable


def test_the_sender_refuses_to_commit_before_every_block_is_sent() -> None:
    link = opened()
    link.send_all((2,))
    with pytest.raises(ValueError):
        link.sender.send_commit()
    assert link.sender.state is SenderState.SENDING


def test_a_sequence_gap_fails_the_attempt() -> None:
    link = opened()
    chunk, data = chunk_of(0, 1)
    with pytest.raises(ProtocolError, match="seq"):
        link.to_receiver(raw(1, 3, chunk), data)  # seq 2 was lost
    refused_with(link, NackCode.SEQUENCE_GAP)


def test_frames_for_another_transfer_change_nothing() -> None:
    link = opened()
    other = Outbound(Envelope(bytes(16), 1, 2), Abort("x"))
    with pytest.raises(ProtocolError):
        link.to_receiver(other)
    assert link.receiver.state is ReceiverState.RECEIVING


# ---- retries -----------------------------------------------------------------------------------


def test_a_failed_attempt_is_discarded_and_a_retry_commits() -> None:
    link = opened()
    chunk, data = chunk_of(0, 2)
    frame = through_wire(link.sender.send_chunk(chunk), data)
    link.receiver.receive(frame.header, frame.message)
    with pytest.raises(ChecksumMismatch):
        link.receiver.data_received(0)
    with pytest.raises(TransferRefused) as refused:
        link.to_sender(link.receiver.take_outgoing())
    assert refused.value.retryable
    stale_chunk, stale_data = chunk_of(2, 2)

    link.sender.restart()
    assert (link.sender.attempt, link.sender.state) == (2, SenderState.IDLE)
    link.open()
    assert link.receiver.attempt == 2
    # A late frame of attempt 1 is fenced off and changes nothing.
    with pytest.raises(StaleAttempt):
        link.to_receiver(raw(1, 3, stale_chunk), stale_data)
    assert link.receiver.state is ReceiverState.RECEIVING
    link.send_all((1, 3))
    assert link.exchange(link.sender.send_commit()) == [SenderAction.RELEASE_LEASE]
    assert link.receiver.verified


def test_a_retry_mid_transfer_replaces_the_old_attempt() -> None:
    link = opened()
    link.send_all((2,))  # attempt 1 stalls here
    link.sender.restart()
    link.open()
    link.send_all((1, 1, 1, 1))  # blocks 0-1 again: the old attempt's chunks are gone
    assert link.exchange(link.sender.send_commit()) == [SenderAction.RELEASE_LEASE]


def test_a_retry_after_commit_is_acknowledged_again_without_new_data() -> None:
    link = opened()
    link.send_all()
    link.to_receiver(link.sender.send_commit())  # the Ack is lost
    assert link.receiver.verified
    link.sender.restart()
    assert link.exchange(link.sender.send_hello()) == [SenderAction.SEND_BEGIN]
    assert link.receiver.state is ReceiverState.COMMITTED_RETRY and link.receiver.verified
    assert link.exchange(link.sender.send_begin(make_begin())) == [SenderAction.RELEASE_LEASE]
    assert link.sender.state is SenderState.DONE
    assert link.receiver.state is ReceiverState.COMMITTED


def test_a_retry_after_commit_with_another_snapshot_keeps_the_verified_kv() -> None:
    link = opened()
    link.send_all()
    link.to_receiver(link.sender.send_commit())
    link.sender.restart()
    link.exchange(link.sender.send_hello())
    with pytest.raises(ProtocolError, match="snapshot_version"):
        link.to_receiver(link.sender.send_begin(make_begin(snapshot_version=2)))
    (nack,) = link.receiver.take_outgoing()
    assert isinstance(nack.message, Nack) and nack.message.code is NackCode.ALREADY_COMMITTED
    assert link.receiver.state is ReceiverState.COMMITTED and link.receiver.verified


def test_a_retry_may_not_go_back_to_an_older_snapshot() -> None:
    link = Link()
    link.open(make_begin(snapshot_version=5))
    link.sender.restart()
    link.exchange(link.sender.send_hello())
    with pytest.raises(ProtocolError, match="older"):
        link.to_receiver(link.sender.send_begin(make_begin(snapshot_version=4)))


def test_attempts_must_open_with_hello_and_hello_only_once() -> None:
    link = opened()
    with pytest.raises(IllegalTransition):
        link.to_receiver(raw(2, 0, make_begin()))
    with pytest.raises(IllegalTransition):
        link.to_receiver(raw(1, 2, Hello(PROTOCOL_VERSION, Role.PREFILL, FP)))
    assert (link.receiver.state, link.receiver.attempt) == (ReceiverState.RECEIVING, 1)


def test_the_sender_fences_replies_of_older_attempts() -> None:
    link = Link()
    link.sender.send_hello()
    link.sender.restart()
    link.sender.send_hello()
    with pytest.raises(StaleAttempt):
        link.to_sender([raw(1, 0, Hello(PROTOCOL_VERSION, Role.DECODE, FP))])
    with pytest.raises(ProtocolError):
        link.to_sender([raw(3, 0, Hello(PROTOCOL_VERSION, Role.DECODE, FP))])
    assert link.sender.state is SenderState.HELLO_SENT
    with pytest.raises(ProtocolError, match="seq"):
        link.to_sender([raw(2, 1, Hello(PROTOCOL_VERSION, Role.DECODE, FP))])
    assert link.sender.state is SenderState.FAILED


# ---- leases, renew, abort ----------------------------------------------------------------------


def test_an_expired_reservation_refuses_further_chunks() -> None:
    clock = FakeClock()
    table = LeaseTable(clock)
    lease = table.grant([10, 11, 12, 13], ttl=5.0, holder="transfer")
    receiver = ReceiverSession(
        make_plan(), FP, guard=lambda: table.check(lease.lease_id, lease.epoch)
    )
    link = Link(receiver)
    link.open()
    link.send_all((2,))
    clock.advance(5.0)
    chunk, data = chunk_of(2, 2)
    with pytest.raises(LeaseExpired):
        link.to_receiver(link.sender.send_chunk(chunk), data)
    refused_with(link, NackCode.LEASE)
    assert [x.lease_id for x in table.expire()] == [lease.lease_id]


def test_renew_extends_the_reservation_through_the_session() -> None:
    clock = FakeClock()
    table = LeaseTable(clock)
    lease = table.grant([1, 2], ttl=5.0, holder="transfer")
    receiver = ReceiverSession(
        make_plan(),
        FP,
        guard=lambda: table.check(lease.lease_id, lease.epoch),
        renew=lambda m: table.renew(m.lease_id, m.epoch, m.ttl),
    )
    link = Link(receiver)
    link.open()
    clock.advance(4.0)
    assert link.exchange(link.sender.send_renew(lease.lease_id, lease.epoch, 5.0)) == [
        SenderAction.NONE
    ]
    clock.advance(4.0)  # past the first deadline, within the renewed one
    link.send_all()
    assert link.exchange(link.sender.send_commit()) == [SenderAction.RELEASE_LEASE]
    clock.advance(2.0)
    with pytest.raises(LeaseExpired):
        table.check(lease.lease_id, lease.epoch)


def test_a_renew_the_lease_table_refuses_fails_the_attempt() -> None:
    clock = FakeClock()
    table = LeaseTable(clock)
    lease = table.grant([1], ttl=1.0, holder="transfer")
    receiver = ReceiverSession(
        make_plan(), FP, renew=lambda m: table.renew(m.lease_id, m.epoch, m.ttl)
    )
    link = Link(receiver)
    link.open()
    clock.advance(2.0)
    with pytest.raises(LeaseExpired):
        link.to_receiver(link.sender.send_renew(lease.lease_id, lease.epoch, 5.0))
    refused_with(link, NackCode.LEASE)


def test_aborts_from_either_side() -> None:
    link = opened()
    assert link.to_receiver(link.sender.send_abort("client went away")) == []
    assert link.sender.state is SenderState.ABORTED
    assert link.receiver.state is ReceiverState.ABORTED

    link = opened()
    assert link.to_sender([link.receiver.abort("deadline")]) == [SenderAction.STOP]
    assert link.sender.state is SenderState.ABORTED and not link.sender.lease_releasable


# ---- the tables, exhaustively ------------------------------------------------------------------


def test_every_pair_missing_from_the_tables_is_illegal() -> None:
    tables: list[tuple[dict[Any, Any], list[Any], list[Any]]] = [
        (dict(SENDER_TRANSITIONS), list(SenderState), list(SenderEvent)),
        (dict(RECEIVER_TRANSITIONS), list(ReceiverState), list(ReceiverEvent)),
    ]
    for table, states, events in tables:
        for state, event in itertools.product(states, events):
            if (state, event) in table:
                assert transition(table, state, event, "t") is table[(state, event)]
            else:
                with pytest.raises(IllegalTransition):
                    transition(table, state, event, "t")


class SenderDriver:
    """Puts a sender into any state, and fires any event at it through its public API."""

    def __init__(self) -> None:
        self.session = SenderSession(TID, FP)
        self.replies = 0

    def reply(self, message: Message) -> None:
        frame = through_wire(raw(self.session.attempt, self.replies, message))
        self.session.receive(frame.header, frame.message)
        self.replies += 1

    def reach(self, state: SenderState) -> SenderDriver:
        s = self.session
        if state is SenderState.ABORTED:
            s.send_abort("x")
            return self
        path = [SenderState.HELLO_SENT, SenderState.READY, SenderState.BEGIN_SENT]
        path += [SenderState.SENDING, SenderState.COMMIT_SENT, SenderState.DONE]
        steps: list[Callable[[], object]] = [
            s.send_hello,
            lambda: self.reply(Hello(PROTOCOL_VERSION, Role.DECODE, FP)),
            lambda: s.send_begin(make_begin()),
            lambda: self.reply(Ack(AckOf.BEGIN)),
            lambda: (s.send_chunk(chunk_of(0, 4)[0]), s.send_commit()),
            lambda: self.reply(Ack(AckOf.COMMIT)),
        ]
        if state is SenderState.FAILED:
            s.send_hello()
            with pytest.raises(TransferRefused):
                self.reply(Nack(NackCode.LEASE, "x", False))
        elif state is not SenderState.IDLE:
            for step in steps[: path.index(state) + 1]:
                step()
        assert s.state is state
        return self

    def fire(self, event: SenderEvent) -> None:
        s = self.session
        actions: dict[SenderEvent, Callable[[], object]] = {
            SenderEvent.SEND_HELLO: s.send_hello,
            SenderEvent.RECV_HELLO: lambda: self.reply(Hello(PROTOCOL_VERSION, Role.DECODE, FP)),
            SenderEvent.SEND_BEGIN: lambda: s.send_begin(make_begin()),
            SenderEvent.RECV_ACK_BEGIN: lambda: self.reply(Ack(AckOf.BEGIN)),
            SenderEvent.SEND_CHUNK: lambda: s.send_chunk(chunk_of(0, 1)[0]),
            SenderEvent.SEND_COMMIT: s.send_commit,
            SenderEvent.RECV_ACK_COMMIT: lambda: self.reply(Ack(AckOf.COMMIT)),
            SenderEvent.SEND_RENEW: lambda: s.send_renew(1, 1, 1.0),
            SenderEvent.RECV_ACK_RENEW: lambda: self.reply(Ack(AckOf.RENEW)),
            SenderEvent.RECV_NACK: lambda: self.reply(Nack(NackCode.LEASE, "x", False)),
            SenderEvent.RECV_ABORT: lambda: self.reply(Abort("x")),
            SenderEvent.RECV_UNEXPECTED: lambda: self.reply(Commit(0, 0, 0)),
            SenderEvent.SEND_ABORT: lambda: s.send_abort("x"),
            SenderEvent.RESTART: s.restart,
        }
        actions[event]()


# FAIL and REJECT are verdicts inside a legal event, not events a caller can send.
SENDER_API_EVENTS = [e for e in SenderEvent if e is not SenderEvent.FAIL]


@pytest.mark.parametrize("state", list(SenderState), ids=lambda s: s.name)
def test_every_illegal_sender_event_raises_and_leaves_the_state(state: SenderState) -> None:
    illegal = [e for e in SENDER_API_EVENTS if (state, e) not in SENDER_TRANSITIONS]
    fired: list[tuple[SenderState, SenderEvent]] = []
    for event in illegal:
        driver = SenderDriver().reach(state)
        attempt = driver.session.attempt
        with pytest.raises(IllegalTransition, match="not allowed") as caught:
            driver.fire(event)
        assert caught.type is IllegalTransition  # from the table, not a stale-attempt fence
        assert (driver.session.state, driver.session.attempt) == (state, attempt), event
        fired.append((state, event))
    assert len(fired) == len(illegal)


class ReceiverDriver:
    """Puts a receiver into any state, and fires any event at it through its public API."""

    def __init__(self) -> None:
        self.session = ReceiverSession(make_plan(), FP)
        self.sent = 0

    def send(self, message: Message, *, new_attempt: bool = False, data: bytes = b"") -> None:
        s = self.session
        attempt = max(s.attempt, 1)
        if new_attempt:
            attempt, self.sent = max(s.attempt + 1, 1), 0
        frame = through_wire(raw(attempt, self.sent, message), data)
        s.receive(frame.header, frame.message)
        self.sent += 1

    def hello(self) -> None:
        self.send(Hello(PROTOCOL_VERSION, Role.PREFILL, FP), new_attempt=True)

    def chunk(self, first: int, num: int) -> None:
        chunk, data = chunk_of(first, num)
        self.send(chunk, data=data)

    def reach(self, state: ReceiverState) -> ReceiverDriver:
        s, R = self.session, ReceiverState
        if state is R.ABORTED:
            s.abort("x")
        if state is R.FAILED:
            self.hello()
            with pytest.raises(Unauthorized):
                self.send(make_begin(capability_token=b"w" * 16))
        if state in (R.HANDSHAKEN, R.RECEIVING, R.CHUNK_PENDING, R.COMMITTED, R.COMMITTED_RETRY):
            self.hello()
        if state in (R.RECEIVING, R.CHUNK_PENDING, R.COMMITTED, R.COMMITTED_RETRY):
            self.send(make_begin())
        if state is R.CHUNK_PENDING:
            self.chunk(0, 1)
        if state in (R.COMMITTED, R.COMMITTED_RETRY):
            self.chunk(0, 4)
            s.data_received(chunk_of(0, 4)[0].payload_checksum)
            self.send(Commit(commit_digest([chunk_of(0, 4)[0]]), 1, 256))
        if state is R.COMMITTED_RETRY:
            self.hello()
        assert s.state is state
        return self

    def fire(self, event: ReceiverEvent) -> None:
        actions: dict[ReceiverEvent, Callable[[], object]] = {
            ReceiverEvent.HELLO: self.hello,
            ReceiverEvent.BEGIN: lambda: self.send(make_begin()),
            ReceiverEvent.CHUNK: lambda: self.chunk(1, 1),
            ReceiverEvent.DATA: lambda: self.session.data_received(0),
            ReceiverEvent.COMMIT: lambda: self.send(Commit(0, 0, 0)),
            ReceiverEvent.RENEW: lambda: self.send(Renew(1, 1, 1.0)),
            ReceiverEvent.ABORT: lambda: self.send(Abort("x")),
            ReceiverEvent.UNEXPECTED: lambda: self.send(Ack(AckOf.BEGIN)),
        }
        actions[event]()


RECEIVER_API_EVENTS = [e for e in ReceiverEvent if e is not ReceiverEvent.REJECT]


@pytest.mark.parametrize("state", list(ReceiverState), ids=lambda s: s.name)
def test_every_illegal_receiver_event_raises_and_leaves_the_state(state: ReceiverState) -> None:
    illegal = [e for e in RECEIVER_API_EVENTS if (state, e) not in RECEIVER_TRANSITIONS]
    for event in illegal:
        driver = ReceiverDriver().reach(state)
        driver.session.take_outgoing()
        attempt, verified = driver.session.attempt, driver.session.verified
        with pytest.raises(IllegalTransition, match="not allowed") as caught:
            driver.fire(event)
        assert caught.type is IllegalTransition
        assert driver.session.state is state, event
        assert (driver.session.attempt, driver.session.verified) == (attempt, verified)
        assert driver.session.take_outgoing() == []  # an illegal event is not answered
    if state is ReceiverState.ABORTED or state in (
        ReceiverState.COMMITTED,
        ReceiverState.COMMITTED_RETRY,
    ):
        with pytest.raises(IllegalTransition):
            ReceiverDriver().reach(state).session.abort("again")
