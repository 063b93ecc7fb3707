"""Fuzz: random and mutated wire frames against the codec (`codec`, `decoder`, `messages`,
`wire`).

What is fuzzed: streams built from valid frames of every message type and from a whole sender
script (see `wire_fuzz`), damaged by frame-level, structure-aware (checksums kept valid) and
byte-level edits, fed to `FrameDecoder` in random splits and to the I/O layer's path
(`decode_header`, `decode_body`, `verify_data`); valid bodies of every message type after byte
edits, straight to `decode_message`; fully random bytes; and random headers with a correct
header checksum followed by random bodies.

Property: every input ends in a result or a `ProtocolError` subclass, never another exception;
a decoder that failed refuses further input; every frame it returns is canonical (re-encoding
it gives back exactly the bytes it consumed), and an undamaged stream decodes completely.

Budget: 150 + 150 + 300 + 200 + 200 examples, fixed seed (`fuzz_support`): about 1.5 s of CPU.
"""

from __future__ import annotations

import pytest
import xxhash
from frame_decoder import FrameDecoder
from fuzz_support import fuzz_settings, note
from hypothesis import given
from hypothesis import strategies as st
from wire_fuzz import (
    SEED_FRAMES,
    damaged_frames,
    damaged_stream,
    edit_bytes,
    frame,
    seal,
    split_at,
)

from pdserve.errors import FrameTruncated, ProtocolError
from pdserve.transfer.codec import (
    HEADER_BYTES,
    MAGIC,
    Frame,
    data_checksum,
    decode_body,
    decode_header,
    verify_data,
)
from pdserve.transfer.messages import PROTOCOL_VERSION, MsgType, decode_message, encode_body

cuts = st.lists(st.integers(0, 2048), max_size=6)


def reencoded(received: Frame) -> bytes:
    """The bytes a frame decoded from the wire must have come from (its canonical encoding)."""
    return frame(received.message, received.data, received.header.envelope)


@fuzz_settings(150)
@given(damaged_stream(SEED_FRAMES), cuts)
def test_the_decoder_types_every_error_and_returns_only_canonical_frames(
    stream: bytes, cut_at: list[int]
) -> None:
    decoder = FrameDecoder()
    consumed, fed = b"", 0
    for piece in split_at(stream, cut_at):
        try:
            frames = decoder.feed(piece)
        except ProtocolError as exc:
            note(f"refused: {type(exc).__name__}")
            with pytest.raises(ProtocolError):  # framing is lost: nothing more is taken
                decoder.feed(b"")
            with pytest.raises(ProtocolError):
                decoder.feed_eof()
            return
        fed += len(piece)
        consumed += b"".join(reencoded(f) for f in frames)
        assert stream[: fed - decoder.num_buffered] == consumed
    try:
        decoder.feed_eof()
    except FrameTruncated:
        note("refused at EOF: FrameTruncated")
        assert decoder.num_buffered > 0
        return
    note(f"decoded {min(len(consumed) // HEADER_BYTES, 3)}+ frames' worth")
    assert consumed == stream


@fuzz_settings(150)
@given(damaged_frames(SEED_FRAMES).map(lambda frames: b"".join(frames)))
def test_the_io_path_types_every_error_and_accepts_only_canonical_frames(stream: bytes) -> None:
    """What `framing.read_frame` and the receiver's landing do, frame after frame: header,
    body, then the data checked over the buffers it landed in (split in two, as across two
    KV blocks)."""
    start = 0
    while start < len(stream):
        try:
            header = decode_header(stream[start : start + HEADER_BYTES])
            end = start + HEADER_BYTES + header.body_len
            message = decode_body(header, stream[start + HEADER_BYTES : end])
            data = stream[end : end + header.data_len]
            verify_data(header, [data[:1], data[1:]])
        except ProtocolError as exc:
            note(f"refused: {type(exc).__name__}")
            return
        note(f"accepted {type(message).__name__}")
        assert stream[start : end + header.data_len] == frame(message, data, header.envelope)
        start = end + header.data_len


# (type, body) of every seed frame: valid bodies of every message type.
SEED_BODIES = [
    (header.msg_type, raw[HEADER_BYTES : HEADER_BYTES + header.body_len])
    for raw in SEED_FRAMES
    for header in [decode_header(raw)]
]


@fuzz_settings(300)
@given(st.sampled_from(SEED_BODIES), st.data())
def test_edited_bodies_of_every_message_type_decode_canonically_or_raise(
    seed: tuple[MsgType, bytes], data: st.DataObject
) -> None:
    """Straight at the message and field decoders (no frame checksum in the way): a valid
    body after 1..3 byte edits is a `ProtocolError` or a message that encodes back to it."""
    msg_type, body = seed
    for _ in range(data.draw(st.integers(1, 3))):
        body = edit_bytes(data.draw, body)
    try:
        message = decode_message(msg_type, body)
    except ProtocolError as exc:
        note(f"{msg_type.name} refused: {type(exc).__name__}")
        return
    note(f"{msg_type.name} decoded")
    assert encode_body(message) == body


@fuzz_settings(200)
@given(st.binary(max_size=400), cuts)
def test_random_bytes_get_a_protocol_error_or_a_wait(garbage: bytes, cut_at: list[int]) -> None:
    decoder = FrameDecoder()
    try:
        for piece in split_at(garbage, cut_at):
            assert decoder.feed(piece) == []
        decoder.feed_eof()
    except ProtocolError:
        return
    assert garbage == b""


@st.composite
def forged_frames(draw: st.DrawFn) -> bytes:
    """A header with every field random (in `codec.HEADER` order) but a correct checksum, a
    random body and random data."""
    body = draw(st.binary(max_size=300))
    data = draw(st.binary(max_size=200))
    fields = [
        MAGIC,
        draw(st.sampled_from([PROTOCOL_VERSION] * 6 + [0, 255])),
        draw(st.integers(0, 12)),
        draw(st.sampled_from([0] * 6 + [1, 0x8000])),
        draw(st.binary(min_size=16, max_size=16)),
        draw(st.integers(0, 2**64 - 1)),
        draw(st.integers(0, 2**32 - 1)),
        draw(st.one_of(st.just(len(body)), st.integers(0, 2**32 - 1))),
        draw(st.one_of(st.just(len(data)), st.integers(0, 2**64 - 1))),
        draw(st.one_of(st.just(xxhash.xxh3_64_intdigest(body)), st.integers(0, 2**64 - 1))),
        draw(st.one_of(st.just(data_checksum([data])), st.integers(0, 2**64 - 1))),
    ]
    return seal(fields) + body + data


@fuzz_settings(200)
@given(forged_frames(), cuts)
def test_forged_headers_with_valid_checksums_get_a_typed_error_or_decode_canonically(
    stream: bytes, cut_at: list[int]
) -> None:
    decoder = FrameDecoder()
    frames: list[Frame] = []
    try:
        for piece in split_at(stream, cut_at):
            frames += decoder.feed(piece)
        decoder.feed_eof()
    except ProtocolError as exc:
        note(f"refused: {type(exc).__name__}")
        return
    note(f"accepted {[type(f.message).__name__ for f in frames]}")
    assert b"".join(reencoded(f) for f in frames) == stream
