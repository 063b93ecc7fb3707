"""Valid KV wire frames from the real encoder, and hypothesis strategies that damage them.

Seeds: one frame of every message type, framed by `codec.encode` (Hello with and without its
MAC, Begin, Chunk with data, Commit with a value digest, Ack of each kind, Nack, Renew, Abort),
and whole valid sender scripts (every frame a sender sends for one attempt of a transfer).

`damaged_stream` mutates a script in two layers. Frame level: drop, duplicate, swap, splice two
frames, insert a foreign frame; structure-aware edits that keep the frame's checksums valid so
the damage reaches the message decoders and the sessions: rewrite a header field (type, flags,
transfer id, seq, attempt, lengths), edit a body, edit Chunk data (checksum left stale, fixed in
the header only, or fixed everywhere so the bytes are wrong but self-consistent). Byte level, on
the joined stream: flip bits, truncate, extend, insert, delete, overwrite. Zero edits in both
layers leaves the script valid, so the happy path is always in the mix.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash
from hypothesis import strategies as st

from pdserve.transfer.byte_ranges import split_payload
from pdserve.transfer.codec import HEADER, HEADER_BYTES, Envelope, data_checksum, encode
from pdserve.transfer.handshake import own_hello
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
    MsgType,
    Nack,
    NackCode,
    Renew,
    Role,
    commit_digest,
    token_digest,
)

FP: dict[str, str | int | float | bool] = {"model": "tiny", "dtype": "float32", "layers": 2}
KEY = b"k" * 32
BLOCK_BYTES = 64
NUM_BLOCKS = 3
# Smaller than a block and not a divisor of it: chunks cover parts of blocks and span two.
FRAME_BYTES = 80
# Header fields by position in `codec.HEADER`.
VERSION, TYPE, FLAGS, TID, SEQ, ATTEMPT, BODY_LEN, DATA_LEN, BODY_SUM, DATA_SUM = range(1, 11)
_CHECKED = HEADER_BYTES - 8
NO_ENVELOPE = Envelope()


@dataclass(frozen=True, slots=True)
class TransferSpec:
    """One transfer as both sides know it: the reservation and the payload the sender holds."""

    transfer_id: bytes
    token: bytes
    request_id: str
    epoch: int
    payload: bytes
    num_tokens: int = 40
    value_digest: bytes = b"canary-digest"

    @property
    def layout(self) -> KVLayout:
        return KVLayout(2, len(self.payload) // BLOCK_BYTES, BLOCK_BYTES, "float32", 16)

    @property
    def token_digest(self) -> bytes:
        return token_digest(list(range(self.num_tokens)))

    def begin(self) -> Begin:
        """The Begin a correct sender sends for this transfer."""
        return Begin(
            self.transfer_id,
            self.request_id,
            1,
            self.layout,
            self.num_tokens,
            self.token_digest,
            self.token,
            self.epoch,
        )


def make_spec(index: int, epoch: int = 7) -> TransferSpec:
    """A transfer with deterministic ids, token and payload (distinct per `index`)."""
    payload = bytes((index * 31 + i * 7) % 251 for i in range(NUM_BLOCKS * BLOCK_BYTES))
    return TransferSpec(
        transfer_id=bytes([index + 1]) * 16,
        token=bytes([index + 101]) * 16,
        request_id=f"req-{index}",
        epoch=epoch,
        payload=payload,
    )


def frame(message: Message, data: bytes = b"", envelope: Envelope = NO_ENVELOPE) -> bytes:
    """`message` (and a Chunk's data) framed by the real encoder, as one bytes object."""
    return b"".join(bytes(part) for part in encode(message, data or None, envelope=envelope))


def script(
    spec: TransferSpec, attempt: int = 1, key: bytes | None = KEY, renew: bool = True
) -> list[bytes]:
    """Every frame a correct sender sends for one attempt, in order."""
    tid = spec.transfer_id
    messages: list[tuple[Message, bytes]] = [
        (own_hello(key, Role.PREFILL, tid, attempt, FP), b""),
        (spec.begin(), b""),
    ]
    chunks = []
    for offset, num_bytes in split_payload(len(spec.payload), FRAME_BYTES):
        data = spec.payload[offset : offset + num_bytes]
        chunk = Chunk(offset, num_bytes, data_checksum([data]))
        chunks.append(chunk)
        messages.append((chunk, data))
        if renew and offset == 0:
            messages.append((Renew(1, spec.epoch, 5.0), b""))
    total = commit_digest(chunks)
    messages.append((Commit(total, len(chunks), len(spec.payload), spec.value_digest), b""))
    return [
        frame(message, data, Envelope(tid, attempt, seq))
        for seq, (message, data) in enumerate(messages)
    ]


SPEC = make_spec(0)
# One valid frame of every message type (Hello with and without MAC; the script's Chunk).
SEED_FRAMES: tuple[bytes, ...] = (
    *script(SPEC),
    frame(Hello(PROTOCOL_VERSION, Role.DECODE, FP)),
    frame(Ack(AckOf.BEGIN), envelope=Envelope(SPEC.transfer_id, 1, 0)),
    frame(Ack(AckOf.COMMIT), envelope=Envelope(SPEC.transfer_id, 1, 1)),
    frame(Ack(AckOf.RENEW), envelope=Envelope(SPEC.transfer_id, 1, 2)),
    frame(Nack(NackCode.CHECKSUM_MISMATCH, "chunk at byte 80", True)),
    frame(Abort("deadline passed"), envelope=Envelope(SPEC.transfer_id, 1, 3)),
)


# ---- random valid messages (foreign frames to insert) -------------------------------------

_u32 = st.integers(0, 2**32 - 1)
_u64 = st.integers(0, 2**64 - 1)
_small = st.integers(0, 12)
_bytes16 = st.binary(min_size=16, max_size=16)


def messages(spec: TransferSpec = SPEC) -> st.SearchStrategy[tuple[Message, bytes]]:
    """Any message with its data, fields random or borrowed from `spec` (so some are close
    to what a receiver expects)."""
    layouts = st.one_of(
        st.just(spec.layout),
        st.builds(
            KVLayout,
            st.integers(1, 4),
            st.integers(1, 5),
            st.integers(1, 128),
            st.sampled_from(["float32", "bf16", ""]),
            st.integers(1, 32),
        ),
    )
    begins = st.builds(
        Begin,
        st.one_of(st.just(spec.transfer_id), _bytes16),
        st.one_of(st.just(spec.request_id), st.text(max_size=8)),
        st.one_of(st.just(1), _u64),
        layouts,
        st.one_of(st.just(spec.num_tokens), _u32),
        st.one_of(st.just(spec.token_digest), _bytes16),
        st.one_of(st.just(spec.token), st.binary(min_size=16, max_size=32)),
        st.one_of(st.just(spec.epoch), _small, _u64),
    )
    hellos = st.builds(
        Hello,
        st.one_of(st.just(PROTOCOL_VERSION), st.integers(0, 2**16 - 1)),
        st.sampled_from(Role),
        st.one_of(st.just(FP), st.dictionaries(st.text(min_size=1, max_size=6), _small)),
        st.one_of(st.just(b""), st.binary(min_size=32, max_size=32)),
    )
    control: st.SearchStrategy[Message] = st.one_of(
        hellos,
        begins,
        st.builds(Commit, _u64, _small, st.integers(0, 400), st.binary(max_size=16)),
        st.builds(Ack, st.sampled_from(AckOf)),
        st.builds(Nack, st.sampled_from(NackCode), st.text(max_size=20), st.booleans()),
        st.builds(
            Renew,
            _small,
            st.one_of(st.just(spec.epoch), _u64),
            st.floats(1e-3, 1e6, allow_nan=False),
        ),
        st.builds(Abort, st.text(max_size=20)),
    )
    return st.one_of(control.map(lambda m: (m, b"")), _chunks(spec))


@st.composite
def _chunks(draw: st.DrawFn, spec: TransferSpec) -> tuple[Message, bytes]:
    size = len(spec.payload)
    offset = draw(st.one_of(st.integers(0, size + 8), _u64))
    data = (
        draw(
            st.one_of(
                st.just(spec.payload[offset : offset + FRAME_BYTES]),
                st.binary(min_size=1, max_size=FRAME_BYTES),
            )
        )
        or b"\0"
    )
    return Chunk(offset, len(data), data_checksum([data])), data


@st.composite
def foreign_frames(draw: st.DrawFn, spec: TransferSpec = SPEC) -> bytes:
    """A valid frame of a random message, for `spec`'s transfer or another, near its seqs."""
    message, data = draw(messages(spec))
    envelope = Envelope(
        draw(st.one_of(st.just(spec.transfer_id), _bytes16, st.just(bytes(16)))),
        draw(st.integers(0, 3)),
        draw(st.integers(0, 12)),
    )
    return frame(message, data, envelope)


# ---- mutations -------------------------------------------------------------------------------


def seal(fields: Sequence[Any]) -> bytes:
    """A header from its fields with a correct header checksum (any field values)."""
    checked = HEADER.pack(*fields[:11], 0)[:_CHECKED]
    return checked + struct.pack("<Q", xxhash.xxh3_64_intdigest(checked))


def _split(raw: bytes) -> tuple[list[Any], bytes, bytes] | None:
    """(header fields, body, data) of a frame-shaped blob, or None if it has no header."""
    if len(raw) < HEADER_BYTES:
        return None
    fields = list(HEADER.unpack(raw[:HEADER_BYTES]))
    body_len = min(fields[BODY_LEN], len(raw) - HEADER_BYTES)
    body = raw[HEADER_BYTES : HEADER_BYTES + body_len]
    return fields, body, raw[HEADER_BYTES + body_len :]


def _boundary_ints(bits: int) -> st.SearchStrategy[int]:
    top = (1 << bits) - 1
    return st.one_of(
        st.sampled_from([0, 1, 2, 3, top, top - 1, 1 << (bits - 1)]), st.integers(0, top)
    )


_FIELD_VALUES: dict[int, st.SearchStrategy[object]] = {
    VERSION: st.sampled_from([0, 1, PROTOCOL_VERSION + 1, 255]),
    TYPE: st.one_of(st.sampled_from([int(t) for t in MsgType]), _boundary_ints(8)),
    FLAGS: _boundary_ints(16),
    TID: st.one_of(st.just(bytes(16)), _bytes16, st.just(make_spec(1).transfer_id)),
    SEQ: st.one_of(st.integers(0, 12), _boundary_ints(64)),
    ATTEMPT: st.one_of(st.integers(0, 4), _boundary_ints(32)),
    BODY_LEN: st.one_of(st.integers(0, 200), _boundary_ints(32)),
    DATA_LEN: st.one_of(st.integers(0, 200), _boundary_ints(64)),
}


def edit_bytes(draw: st.DrawFn, raw: bytes) -> bytes:
    """One byte-level edit: flip bits, truncate, extend, insert, delete or overwrite."""
    kind = draw(st.sampled_from(["flip", "truncate", "extend", "insert", "delete", "write"]))
    n = len(raw)
    if kind == "extend" or n == 0:
        return raw + draw(st.binary(min_size=1, max_size=96))
    pos = draw(st.integers(0, n - 1))
    if kind == "flip":
        out = bytearray(raw)
        for bit in draw(st.lists(st.integers(0, n * 8 - 1), min_size=1, max_size=8)):
            out[bit // 8] ^= 1 << (bit % 8)
        return bytes(out)
    if kind == "truncate":
        return raw[:pos]
    if kind == "insert":
        return raw[:pos] + draw(st.binary(min_size=1, max_size=32)) + raw[pos:]
    if kind == "delete":
        return raw[:pos] + raw[pos + draw(st.integers(1, 64)) :]
    return raw[:pos] + bytes([draw(st.integers(0, 255))]) + raw[pos + 1 :]


def _edit_header_field(draw: st.DrawFn, raw: bytes) -> bytes:
    parts = _split(raw)
    if parts is None:
        return raw
    fields, body, data = parts
    index = draw(st.sampled_from(sorted(_FIELD_VALUES)))
    fields[index] = draw(_FIELD_VALUES[index])
    return seal(fields) + body + data


def _edit_body(draw: st.DrawFn, raw: bytes) -> bytes:
    parts = _split(raw)
    if parts is None:
        return raw
    fields, body, data = parts
    body = edit_bytes(draw, body)
    fields[BODY_LEN], fields[BODY_SUM] = len(body), xxhash.xxh3_64_intdigest(body)
    return seal(fields) + body + data


def _edit_data(draw: st.DrawFn, raw: bytes) -> bytes:
    parts = _split(raw)
    if parts is None or not parts[2]:
        return raw
    fields, body, data = parts
    data = edit_bytes(draw, data) or b"\0"
    repair = draw(st.sampled_from(["stale", "header", "everywhere"]))
    if repair == "header":
        fields[DATA_LEN], fields[DATA_SUM] = len(data), data_checksum([data])
    elif repair == "everywhere" and fields[TYPE] == MsgType.CHUNK and len(body) >= 8:
        offset = struct.unpack_from("<Q", body)[0]
        chunk = Chunk(offset, len(data), data_checksum([data]))
        envelope = Envelope(fields[TID], fields[ATTEMPT], fields[SEQ])
        return frame(chunk, data, envelope)
    return seal(fields) + body + data


Edit = Callable[[st.DrawFn, list[bytes]], list[bytes]]


def _at(draw: st.DrawFn, frames: list[bytes]) -> int:
    return draw(st.integers(0, len(frames) - 1))


def _drop(draw: st.DrawFn, frames: list[bytes]) -> list[bytes]:
    i = _at(draw, frames)
    return frames[:i] + frames[i + 1 :]


def _duplicate(draw: st.DrawFn, frames: list[bytes]) -> list[bytes]:
    i, j = _at(draw, frames), _at(draw, frames)
    return [*frames[:j], frames[i], *frames[j:]]


def _swap(draw: st.DrawFn, frames: list[bytes]) -> list[bytes]:
    i, j = _at(draw, frames), _at(draw, frames)
    out = list(frames)
    out[i], out[j] = out[j], out[i]
    return out


def _splice(draw: st.DrawFn, frames: list[bytes]) -> list[bytes]:
    i, j = _at(draw, frames), _at(draw, frames)
    a, b = frames[i], frames[j]
    cut_a, cut_b = draw(st.integers(0, len(a))), draw(st.integers(0, len(b)))
    out = list(frames)
    out[i] = a[:cut_a] + b[cut_b:]
    return out


def _insert_foreign(draw: st.DrawFn, frames: list[bytes]) -> list[bytes]:
    j = draw(st.integers(0, len(frames)))
    return [*frames[:j], draw(foreign_frames()), *frames[j:]]


def _in_place(edit: Callable[[st.DrawFn, bytes], bytes]) -> Edit:
    def apply(draw: st.DrawFn, frames: list[bytes]) -> list[bytes]:
        i = _at(draw, frames)
        return [*frames[:i], edit(draw, frames[i]), *frames[i + 1 :]]

    return apply


FRAME_EDITS: tuple[Edit, ...] = (
    _drop,
    _duplicate,
    _swap,
    _splice,
    _insert_foreign,
    _in_place(_edit_header_field),
    _in_place(_edit_body),
    _in_place(_edit_data),
)


@st.composite
def damaged_frames(draw: st.DrawFn, frames: Sequence[bytes], max_edits: int = 3) -> list[bytes]:
    """`frames` after 0..max_edits frame-level and structure-aware edits."""
    out = list(frames)
    for _ in range(draw(st.integers(0, max_edits))):
        out = draw(st.sampled_from(FRAME_EDITS))(draw, out) if out else [draw(foreign_frames())]
    return out


@st.composite
def damaged_stream(
    draw: st.DrawFn, frames: Sequence[bytes], max_edits: int = 3, max_byte_edits: int = 2
) -> bytes:
    """The joined bytes of `damaged_frames`, then 0..max_byte_edits byte-level edits."""
    raw = b"".join(draw(damaged_frames(frames, max_edits)))
    for _ in range(draw(st.integers(0, max_byte_edits))):
        raw = edit_bytes(draw, raw)
    return raw


def split_at(raw: bytes, cuts: Sequence[int]) -> list[bytes]:
    """`raw` cut at the given offsets (clipped and sorted): how a stream may arrive."""
    points = sorted({min(max(c, 0), len(raw)) for c in cuts} | {0, len(raw)})
    return [raw[a:b] for a, b in itertools.pairwise(points)] or [b""]
