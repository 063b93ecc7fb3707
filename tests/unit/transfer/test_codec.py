"""The wire codec: frame layout, round trips, and typed errors on damaged or hostile input."""

from __future__ import annotations

import struct

import pytest
import xxhash
from frame_decoder import FrameDecoder
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.errors import (
    BadMagic,
    ChecksumMismatch,
    FrameTooLarge,
    FrameTruncated,
    ProtocolError,
    UnsupportedVersion,
)
from pdserve.transfer.codec import (
    HEADER,
    HEADER_BYTES,
    MAGIC,
    MAX_BODY_BYTES,
    MAX_DATA_BYTES,
    Envelope,
    FrameHeader,
    data_checksum,
    decode_body,
    decode_header,
    encode,
    verify_data,
)
from pdserve.transfer.messages import (
    DATA_TYPES,
    MESSAGE_TYPES,
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
    MsgType,
    Nack,
    NackCode,
    Renew,
    Role,
    commit_digest,
    encode_body,
    token_digest,
)
from pdserve.transfer.wire import encode_fingerprint

# ---- strategies --------------------------------------------------------------------------------

u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
pos32 = st.integers(1, 2**32 - 1)
transfer_ids = st.binary(min_size=16, max_size=16)
envelopes = st.builds(Envelope, transfer_ids, u32, u64)
fingerprint_values = st.one_of(
    st.text(max_size=24),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
)
fingerprints = st.dictionaries(st.text(min_size=1, max_size=16), fingerprint_values, max_size=8)
layouts = st.builds(KVLayout, pos32, pos32, pos32, st.text(max_size=8), pos32)
positive_floats = st.floats(min_value=0, exclude_min=True, allow_nan=False, allow_infinity=False)

control_messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(Hello, u16, st.sampled_from(Role), fingerprints),
    st.builds(
        Begin,
        transfer_ids,
        st.text(max_size=40),
        u64,
        layouts,
        u32,
        st.binary(min_size=16, max_size=16),
        st.binary(min_size=16, max_size=32),
    ),
    st.builds(Commit, u64, u32, u64),
    st.builds(Ack, st.sampled_from(AckOf)),
    st.builds(Nack, st.sampled_from(NackCode), st.text(max_size=80), st.booleans()),
    st.builds(Renew, u64, u64, positive_floats),
    st.builds(Abort, st.text(max_size=80)),
)


@st.composite
def chunks_with_data(draw: st.DrawFn) -> tuple[Chunk, list[bytes]]:
    """A Chunk and its data split into 1..4 buffers."""
    parts = draw(st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=4))
    chunk = Chunk(draw(u32), draw(pos32), data_checksum(parts))
    return chunk, parts


framed: st.SearchStrategy[tuple[Message, list[bytes]]] = st.one_of(
    control_messages.map(lambda m: (m, [])),
    chunks_with_data(),
)


NO_ENVELOPE = Envelope()


def wire_bytes(message: Message, data: list[bytes], envelope: Envelope = NO_ENVELOPE) -> bytes:
    return b"".join(bytes(part) for part in encode(message, data or None, envelope=envelope))


HELLO = Hello(PROTOCOL_VERSION, Role.PREFILL, {"model": "tiny", "dtype": "bf16", "layers": 2})
TID = bytes(range(16))
SAMPLES: list[tuple[Message, list[bytes]]] = [
    (HELLO, []),
    (
        Begin(TID, "req-1", 3, KVLayout(2, 4, 64, "bf16", 16), 50, token_digest([1, 2]), b"k" * 16),
        [],
    ),
    (Chunk(2, 1, data_checksum([b"\x07" * 64])), [b"\x07" * 64]),
    (Commit(0xDEADBEEF, 2, 256), []),
    (Ack(AckOf.COMMIT), []),
    (Nack(NackCode.CHECKSUM_MISMATCH, "chunk 2", True), []),
    (Renew(9, 4, 2.5), []),
    (Abort("deadline passed"), []),
]


# ---- layout -----------------------------------------------------------------------------------


def test_header_layout_is_pinned() -> None:
    envelope = Envelope(TID, attempt=7, seq=0x0102030405060708)
    data = b"\xab" * 64
    chunk = Chunk(2, 1, data_checksum([data]))
    raw = wire_bytes(chunk, [data], envelope)
    body = encode_body(chunk)
    assert HEADER_BYTES == 72
    assert raw[0:4] == MAGIC == b"PDKV"
    assert raw[4] == PROTOCOL_VERSION
    assert raw[5] == MsgType.CHUNK
    assert raw[6:8] == b"\0\0"
    assert raw[8:24] == TID
    assert struct.unpack_from("<QIIQQQQ", raw, 24) == (
        0x0102030405060708,
        7,
        len(body),
        64,
        xxhash.xxh3_64_intdigest(body),
        xxhash.xxh3_64_intdigest(data),
        xxhash.xxh3_64_intdigest(raw[:64]),
    )
    assert raw[72 : 72 + len(body)] == body and raw[72 + len(body) :] == data


def test_encode_passes_data_buffers_through_without_copying() -> None:
    block0, block1 = b"\x01" * 32, bytearray(b"\x02" * 32)
    view = memoryview(block1)
    chunk = Chunk(0, 2, data_checksum([block0, view]))
    parts = encode(chunk, [block0, view])
    assert parts[1] is block0 and parts[2] is view
    assert isinstance(parts[0], bytes) and len(parts) == 3


def test_encode_flattens_typed_views_over_the_same_memory() -> None:
    import array

    floats = array.array("f", [1.0, 2.0, 3.0, 4.0])
    chunk = Chunk(0, 1, data_checksum([memoryview(floats).cast("B")]))
    parts = encode(chunk, memoryview(floats))
    assert isinstance(parts[1], memoryview) and parts[1].format == "B"
    floats[0] = 9.0  # same memory: the frame's view sees the change
    assert bytes(parts[1][:4]) == struct.pack("f", 9.0)


def test_checksum_streams_over_buffers_in_order() -> None:
    parts: list[bytes | bytearray | memoryview] = [b"abc", memoryview(b"defg"), bytearray(b"h")]
    assert data_checksum(parts) == xxhash.xxh3_64_intdigest(b"abcdefgh")
    assert data_checksum([b"defg", b"abc", b"h"]) != data_checksum(parts)


# ---- round trips -------------------------------------------------------------------------------


@settings(max_examples=300)
@given(framed, envelopes)
def test_every_message_round_trips_through_the_decoder(
    item: tuple[Message, list[bytes]], envelope: Envelope
) -> None:
    message, data = item
    frames = FrameDecoder().feed(wire_bytes(message, data, envelope))
    assert len(frames) == 1
    assert frames[0].message == message
    assert frames[0].header.envelope == envelope
    assert frames[0].data == b"".join(data)


@settings(max_examples=300)
@given(framed, envelopes)
def test_every_message_round_trips_through_header_and_body(
    item: tuple[Message, list[bytes]], envelope: Envelope
) -> None:
    message, data = item
    raw = wire_bytes(message, data, envelope)
    header = decode_header(memoryview(raw)[:HEADER_BYTES])
    body = raw[HEADER_BYTES : HEADER_BYTES + header.body_len]
    assert decode_body(header, body) == message
    landed = raw[HEADER_BYTES + header.body_len :]
    assert len(landed) == header.data_len
    verify_data(header, [landed[:1], landed[1:]])  # as if read into two KV blocks


@settings(max_examples=100)
@given(st.lists(framed, min_size=1, max_size=5), st.data())
def test_decoder_accepts_any_split(
    items: list[tuple[Message, list[bytes]]], data: st.DataObject
) -> None:
    stream = b"".join(wire_bytes(m, d) for m, d in items)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    decoder, frames, start = FrameDecoder(), [], 0
    for cut in [*cuts, len(stream)]:
        frames += decoder.feed(stream[start:cut])
        start = cut
    decoder.feed_eof()
    assert [f.message for f in frames] == [m for m, _ in items]
    assert decoder.num_buffered == 0


def test_hello_fingerprint_is_a_private_read_only_copy() -> None:
    fields: dict[str, str | int | float | bool] = {"b": 1, "a": "x"}
    hello = Hello(PROTOCOL_VERSION, Role.DECODE, fields)
    fields["a"] = "changed"
    assert hello.fingerprint == {"a": "x", "b": 1}
    with pytest.raises(TypeError):
        hello.fingerprint["a"] = "y"  # type: ignore[index]


def test_fingerprint_encoding_is_canonical() -> None:
    assert encode_fingerprint({"a": 1, "b": "x"}) == encode_fingerprint({"b": "x", "a": 1})
    assert encode_fingerprint({"a": -0.0}) == encode_fingerprint({"a": 0.0})
    assert encode_fingerprint({"a": True}) != encode_fingerprint({"a": 1})
    for bad in ({"a": float("nan")}, {"": 1}, {"a": None}, {"a": 2**63}, {"k" * 65: 1}):
        with pytest.raises(ValueError):
            encode_fingerprint(bad)  # type: ignore[arg-type]


# ---- truncation --------------------------------------------------------------------------------


@pytest.mark.parametrize("message,data", SAMPLES, ids=lambda v: type(v).__name__)
def test_truncation_at_every_point_is_reported(message: Message, data: list[bytes]) -> None:
    raw = wire_bytes(message, data)
    for cut in range(len(raw)):
        decoder = FrameDecoder()
        assert decoder.feed(raw[:cut]) == []
        if cut:
            with pytest.raises(FrameTruncated):
                decoder.feed_eof()
        else:
            decoder.feed_eof()  # an empty stream is a clean end
        if cut < HEADER_BYTES:
            with pytest.raises(FrameTruncated):
                decode_header(raw[:cut])
    header = decode_header(raw)
    body = raw[HEADER_BYTES : HEADER_BYTES + header.body_len]
    for cut in range(len(body)):
        with pytest.raises(FrameTruncated):
            decode_body(header, body[:cut])
    if header.data_len:
        with pytest.raises(FrameTruncated):
            verify_data(header, [raw[-header.data_len : -1]])


@settings(max_examples=200)
@given(st.lists(framed, min_size=1, max_size=3), st.data())
def test_a_stream_cut_anywhere_yields_whole_frames_then_truncation(
    items: list[tuple[Message, list[bytes]]], data: st.DataObject
) -> None:
    frames = [wire_bytes(m, d) for m, d in items]
    stream = b"".join(frames)
    cut = data.draw(st.integers(0, len(stream) - 1))
    decoder = FrameDecoder()
    got = decoder.feed(stream[:cut])
    ends = [sum(len(f) for f in frames[: i + 1]) for i in range(len(frames))]
    assert [f.message for f in got] == [
        m for (m, _), end in zip(items, ends, strict=True) if end <= cut
    ]
    if cut in (0, *ends):
        decoder.feed_eof()
    else:
        with pytest.raises(FrameTruncated):
            decoder.feed_eof()


# ---- bit flips ---------------------------------------------------------------------------------

DETECTED = (ChecksumMismatch, BadMagic, UnsupportedVersion)


def flip(raw: bytes, bit: int) -> bytes:
    damaged = bytearray(raw)
    damaged[bit // 8] ^= 1 << (bit % 8)
    return bytes(damaged)


@pytest.mark.parametrize("message,data", SAMPLES, ids=lambda v: type(v).__name__)
def test_every_single_bit_flip_is_detected(message: Message, data: list[bytes]) -> None:
    raw = wire_bytes(message, data)
    for bit in range(len(raw) * 8):
        with pytest.raises(DETECTED):
            FrameDecoder().feed(flip(raw, bit))


@settings(max_examples=300)
@given(framed, envelopes, st.data())
def test_random_bit_flips_in_header_or_body_are_detected(
    item: tuple[Message, list[bytes]], envelope: Envelope, data: st.DataObject
) -> None:
    message, payload = item
    raw = wire_bytes(message, payload, envelope)
    header = decode_header(raw)
    bit = data.draw(st.integers(0, (HEADER_BYTES + header.body_len) * 8 - 1))
    damaged = flip(raw, bit)
    with pytest.raises(DETECTED):
        FrameDecoder().feed(damaged)
    if bit >= HEADER_BYTES * 8:  # the header is intact: the body check catches it
        with pytest.raises(ChecksumMismatch):
            decode_body(header, damaged[HEADER_BYTES : HEADER_BYTES + header.body_len])


@settings(max_examples=200)
@given(chunks_with_data(), st.data())
def test_bit_flips_in_data_are_caught_by_the_chunk_checksum(
    item: tuple[Chunk, list[bytes]], data: st.DataObject
) -> None:
    chunk, parts = item
    raw = wire_bytes(chunk, parts)
    header = decode_header(raw)
    start = HEADER_BYTES + header.body_len
    bit = data.draw(st.integers(start * 8, len(raw) * 8 - 1))
    damaged = flip(raw, bit)
    with pytest.raises(ChecksumMismatch):
        FrameDecoder().feed(damaged)
    # The zero-copy path: the data landed in KV memory, then is checked against the Chunk.
    assert decode_body(header, damaged[HEADER_BYTES:start]) == chunk
    assert data_checksum([damaged[start:]]) != chunk.payload_checksum
    with pytest.raises(ChecksumMismatch):
        verify_data(header, [damaged[start:]])


# ---- hostile lengths and garbage ---------------------------------------------------------------


def forge_header(
    msg_type: int = MsgType.HELLO,
    *,
    body: bytes = b"",
    data_len: int = 0,
    body_len: int | None = None,
    flags: int = 0,
    data_sum: int = 0,
) -> bytes:
    """A header with valid checksums over whatever fields it is given."""
    size = len(body) if body_len is None else body_len
    fields = (MAGIC, PROTOCOL_VERSION, msg_type, flags, TID, 0, 1, size, data_len)
    packed = HEADER.pack(*fields, xxhash.xxh3_64_intdigest(body), data_sum, 0)[:64]
    return packed + struct.pack("<Q", xxhash.xxh3_64_intdigest(packed))


@pytest.mark.parametrize(
    "header",
    [
        forge_header(body_len=MAX_BODY_BYTES + 1),
        forge_header(body_len=2**32 - 1),
        forge_header(MsgType.CHUNK, data_len=MAX_DATA_BYTES + 1),
        forge_header(MsgType.CHUNK, data_len=2**64 - 1),
    ],
)
def test_oversized_lengths_are_refused_from_the_header_alone(header: bytes) -> None:
    with pytest.raises(FrameTooLarge):
        decode_header(header)
    decoder = FrameDecoder()
    with pytest.raises(FrameTooLarge):
        decoder.feed(header)  # nothing after the header: no wait, no allocation


def test_decoder_bounds_are_configurable() -> None:
    raw = wire_bytes(Abort("x" * 100), [])
    with pytest.raises(FrameTooLarge):
        FrameDecoder(max_body_bytes=50).feed(raw)
    with pytest.raises(FrameTooLarge):
        decode_header(raw, max_body_bytes=50)


@pytest.mark.parametrize(
    "header,error",
    [
        (forge_header(99), ProtocolError),  # unknown type
        (forge_header(flags=0x8000), ProtocolError),  # unknown flag
        (forge_header(MsgType.HELLO, data_len=8), ProtocolError),  # data on a control frame
        (forge_header(MsgType.CHUNK, data_len=0), ProtocolError),  # a chunk without data
        (b"XDKV" + forge_header()[4:], BadMagic),
        (
            forge_header()[:4] + bytes([PROTOCOL_VERSION - 1]) + forge_header()[5:],
            UnsupportedVersion,
        ),  # old
        (
            forge_header()[:4] + bytes([PROTOCOL_VERSION + 1]) + forge_header()[5:],
            UnsupportedVersion,
        ),  # future
    ],
)
def test_well_checksummed_but_invalid_headers_are_refused(header: bytes, error: type) -> None:
    with pytest.raises(error):
        decode_header(header)


def test_chunk_body_must_agree_with_the_header_data_checksum() -> None:
    body = encode_body(Chunk(0, 1, 1234))
    header = decode_header(forge_header(MsgType.CHUNK, body=body, data_len=4, data_sum=999))
    with pytest.raises(ChecksumMismatch):
        decode_body(header, body)


def test_trailing_bytes_in_a_body_are_refused() -> None:
    body = encode_body(Ack(AckOf.BEGIN)) + b"\0"
    header = decode_header(forge_header(MsgType.ACK, body=body))
    with pytest.raises(ProtocolError):
        decode_body(header, body)
    with pytest.raises(ProtocolError):
        decode_body(header, body + b"more")


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_garbage_raises_a_protocol_error_or_waits(garbage: bytes) -> None:
    decoder = FrameDecoder()
    try:
        frames = decoder.feed(garbage)
    except ProtocolError:
        return
    assert frames == []  # only a prefix of a valid header can be waited on
    assert garbage == MAGIC[: len(garbage)] or garbage.startswith(MAGIC)


@settings(max_examples=300)
@given(st.sampled_from(sorted(MESSAGE_TYPES)), st.binary(max_size=120))
def test_random_bodies_decode_canonically_or_raise(msg_type: MsgType, body: bytes) -> None:
    header = decode_header(
        forge_header(msg_type, body=body, data_len=1 if msg_type in DATA_TYPES else 0)
    )
    try:
        message = decode_body(header, body)
    except ProtocolError:
        return
    assert encode_body(message) == body  # one message, one encoding


def test_decoder_refuses_input_after_an_error() -> None:
    decoder = FrameDecoder()
    with pytest.raises(BadMagic):
        decoder.feed(b"GET / HTTP/1.1\r\n")
    with pytest.raises(ProtocolError):
        decoder.feed(wire_bytes(HELLO, []))


# ---- local misuse ------------------------------------------------------------------------------


def test_encode_refuses_local_misuse() -> None:
    data = b"\1" * 8
    with pytest.raises(ValueError, match="payload_checksum"):
        encode(Chunk(0, 1, data_checksum([data]) ^ 1), data)
    with pytest.raises(ValueError):
        encode(Chunk(0, 1, 0))  # no data
    with pytest.raises(ValueError):
        encode(HELLO, data)
    with pytest.raises(ValueError):
        encode(Chunk(0, 0, data_checksum([data])), data)  # num_blocks >= 1
    with pytest.raises(ValueError):
        encode(Begin(TID, "r", 0, KVLayout(1, 1, 1, "f", 1), 0, b"short", b"k" * 16))
    with pytest.raises(ValueError):
        encode(Renew(1, 1, 0.0))
    with pytest.raises(ValueError):
        encode(Ack(AckOf.BEGIN), envelope=Envelope(TID, attempt=2**32))
    with pytest.raises(ValueError):
        encode(Chunk(0, 1, 0), memoryview(bytearray(16))[::2])  # not contiguous
    with pytest.raises(ValueError):
        encode(Abort("é" * 2000))  # over the text bound
    # Trusting a precomputed checksum skips the data pass (the caller vouches for it).
    assert len(encode(Chunk(0, 1, 5), data, verify_data=False)) == 2


# ---- digests -----------------------------------------------------------------------------------


def test_token_digest() -> None:
    digest = token_digest([1, 2, 3])
    assert len(digest) == 16 and digest == token_digest((1, 2, 3))
    assert digest != token_digest([1, 2, 4]) and digest != token_digest([1, 2])
    assert token_digest([]) != token_digest([0])
    with pytest.raises(ValueError):
        token_digest([-1])
    with pytest.raises(ValueError):
        token_digest([2**32])


def test_commit_digest_covers_chunks_in_block_order() -> None:
    a, b = Chunk(0, 2, 11), Chunk(2, 2, 22)
    assert commit_digest([a, b]) == commit_digest([b, a])
    assert commit_digest([a, b]) != commit_digest([a, Chunk(2, 2, 23)])
    assert commit_digest([a, b]) != commit_digest([Chunk(0, 1, 11), Chunk(1, 3, 22)])
    assert commit_digest([a]) != commit_digest([a, b])


def test_frame_header_is_a_plain_value() -> None:
    header = decode_header(wire_bytes(HELLO, []))
    assert isinstance(header, FrameHeader)
    assert header.msg_type is MsgType.HELLO and header.data_len == 0
