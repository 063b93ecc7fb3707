"""The typed messages of the KV transfer protocol, each with its body schema declared once.

One transfer attempt, sender (S) and receiver (R):

    S: Hello → R: Hello (or Nack: cluster credential / fingerprint / version)
    S: Begin → R: Ack(BEGIN) (or Nack: token / epoch / plan; or Ack(COMMIT) if committed)
    S: Chunk + data, Chunk + data, …          (R: Nack on the first bad chunk)
    S: Commit → R: Ack(COMMIT) (or Nack: digest / counts)

Version 2 (this one): chunks are byte ranges of the transfer's payload (its blocks laid end to
end), so a block larger than a frame travels as several chunks; Hello carries a MAC under the
cluster secret (both directions, so each side knows the other is a cluster member before any KV
moves); Begin carries the reservation's lease epoch (a sender fenced by a newer grant is
refused); Commit carries the prefill side's value digest of the KV (the canary, opaque here).
    S: Renew  → R: Ack(RENEW) at any point while the attempt is open; either side: Abort

A checkpoint replication link (`link_session.py`) reuses the frames for a long-lived stream
from a decode worker (W) to its checkpoint holder (H), one handshake per connection:

    W: Hello(REPLICA) → H: Hello (its MAC binds W's link id and H's fresh nonce)
    W: Put + data → H: Ack(PUT) (or Nack: CHECKPOINT_REFUSED, CHECKSUM_MISMATCH, …), repeated

Every message is a frozen slots dataclass. Its `WIRE` tuple lists `(field, codec)` pairs in
dataclass order (checked at import); `encode_body` and `decode_message` both walk that tuple,
so there is no second, hand-kept unpacking order. Bodies are struct-packed and bounded
(`wire.py`); never pickle, never JSON.

This module knows about messages and their fields only: not frames, checksums of frames,
sessions, sockets or KV memory.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from types import MappingProxyType
from typing import ClassVar

import xxhash

from pdserve.errors import ProtocolError
from pdserve.transfer.wire import (
    Bool,
    Bytes,
    EnumU8,
    Fingerprint,
    FingerprintValue,
    Nested,
    PositiveFloat,
    Reader,
    Schema,
    Str,
    U32Array,
    UInt,
    check_schema,
    encode_fingerprint,
    read_fields,
    write_fields,
)

PROTOCOL_VERSION = 3
TRANSFER_ID_BYTES = 16
MIN_TOKEN_BYTES = 16
MAX_TOKEN_BYTES = 32
TOKEN_DIGEST_BYTES = 16
MAX_REQUEST_ID_BYTES = 256
MAX_TEXT_BYTES = 2048
# HMAC-SHA256 tag of a Hello under the cluster secret; empty where no secret is configured.
HELLO_AUTH_BYTES = 32
# A worker process's instance id (drawn at start, `worker/server.py`).
INSTANCE_BYTES = 16
# The Commit's value digest (an opaque canary the decode side recomputes and compares).
MAX_VALUE_DIGEST_BYTES = 255


class MsgType(IntEnum):
    """The frame header's message type byte."""

    HELLO = 1
    BEGIN = 2
    CHUNK = 3
    COMMIT = 4
    ACK = 5
    NACK = 6
    RENEW = 7
    ABORT = 8
    PUT = 9


class Role(IntEnum):
    """The role of the worker that sends a Hello."""

    PREFILL = 1
    DECODE = 2
    BOTH = 3
    # The writer of a checkpoint replication link (a decode worker sending its requests' KV).
    REPLICA = 4


class AckOf(IntEnum):
    """What an Ack acknowledges."""

    BEGIN = 1
    COMMIT = 2
    RENEW = 3
    PUT = 4


class NackCode(IntEnum):
    """Why a receiver refused; `NACK_RETRYABLE` says whether a new attempt can succeed."""

    FINGERPRINT_MISMATCH = 1
    VERSION_MISMATCH = 2
    UNAUTHORIZED = 3
    BEGIN_MISMATCH = 4
    CHUNK_OUT_OF_RANGE = 5
    CHUNK_OVERLAP = 6
    CHECKSUM_MISMATCH = 7
    COMMIT_MISMATCH = 8
    SEQUENCE_GAP = 9
    LEASE = 10
    ALREADY_COMMITTED = 11
    # No reservation is waiting for this transfer id (never made, expired or cancelled).
    UNKNOWN_TRANSFER = 12
    # The peer's Hello carries no valid MAC under the cluster secret.
    UNAUTHENTICATED = 13
    # A checkpoint holder refused a Put (full, chain, version): the writer stops replicating.
    CHECKPOINT_REFUSED = 14
    # The Hello names another instance of this address: the reservation it follows belonged
    # to a previous life of the process, and died with it.
    STALE_INSTANCE = 15


# Damage in flight (checksums, lost frames) is worth a resend; a refusal on identity is not.
NACK_RETRYABLE: Mapping[NackCode, bool] = MappingProxyType(
    {
        code: code in {NackCode.CHECKSUM_MISMATCH, NackCode.COMMIT_MISMATCH, NackCode.SEQUENCE_GAP}
        for code in NackCode
    }
)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of the KV being moved; `block_bytes` is one block across every layer."""

    num_layers: int
    num_blocks: int  # blocks in this transfer
    block_bytes: int  # contiguous bytes of one block (all layers, K and V)
    dtype: str
    block_size: int  # tokens per block

    WIRE: ClassVar[Schema] = (
        ("num_layers", UInt(32, lo=1)),
        ("num_blocks", UInt(32, lo=1)),
        ("block_bytes", UInt(32, lo=1)),
        ("dtype", Str(32)),
        ("block_size", UInt(32, lo=1)),
    )

    @property
    def payload_bytes(self) -> int:
        """Bytes of the whole transfer: its blocks laid end to end."""
        return self.num_blocks * self.block_bytes


@dataclass(frozen=True, slots=True)
class Hello:
    """Opens an attempt; each side states its protocol version, role and build fingerprint."""

    protocol_version: int
    role: Role
    # Normalised to a read-only mapping; compared field by field at the handshake.
    fingerprint: Mapping[str, FingerprintValue]
    # `handshake.mac` of this Hello under the cluster secret (b"" when the cluster has none).
    auth: bytes = b""
    # The receiving process's instance (its life, from the reservation) this Hello is meant
    # for; b"": whichever answers. A process restarted at the same address refuses it.
    peer_instance: bytes = b""

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    WIRE: ClassVar[Schema] = (
        ("protocol_version", UInt(16)),
        ("role", EnumU8(Role)),
        ("fingerprint", Fingerprint()),
        ("auth", Bytes(0, HELLO_AUTH_BYTES)),
        ("peer_instance", Bytes(0, INSTANCE_BYTES)),
    )

    def __post_init__(self) -> None:
        encode_fingerprint(self.fingerprint, "Hello.fingerprint")  # bounds, at construction
        # A private copy: the caller's dict may change after the Hello is built.
        frozen = MappingProxyType(dict(sorted(self.fingerprint.items())))
        object.__setattr__(self, "fingerprint", frozen)


@dataclass(frozen=True, slots=True)
class Begin:
    """Announces one transfer: what KV, for which prompt, under which capability token."""

    transfer_id: bytes  # 16 bytes, equal to the frame header's
    request_id: str
    snapshot_version: int  # the prefill snapshot being sent; never decreases across attempts
    layout: KVLayout
    num_tokens: int
    token_digest: bytes  # token_digest(prompt token ids)
    capability_token: bytes  # 16..32 bytes handed out with the decode reservation
    # Fencing token of the reservation's lease on the decode side: a Begin naming an older
    # epoch comes from a sender that outlived its grant and is refused.
    epoch: int = 0

    TYPE: ClassVar[MsgType] = MsgType.BEGIN
    WIRE: ClassVar[Schema] = (
        ("transfer_id", Bytes(TRANSFER_ID_BYTES, TRANSFER_ID_BYTES)),
        ("request_id", Str(MAX_REQUEST_ID_BYTES)),
        ("snapshot_version", UInt(64)),
        ("layout", Nested(KVLayout)),
        ("num_tokens", UInt(32)),
        ("token_digest", Bytes(TOKEN_DIGEST_BYTES, TOKEN_DIGEST_BYTES)),
        ("capability_token", Bytes(MIN_TOKEN_BYTES, MAX_TOKEN_BYTES)),
        ("epoch", UInt(64)),
    )


@dataclass(frozen=True, slots=True)
class Chunk:
    """Bytes `[offset, offset + num_bytes)` of the transfer's payload; data follows the body.

    The payload is the transfer's blocks laid end to end (`layout.num_blocks * block_bytes`
    bytes): a chunk may cover part of one block, or the end of one and the start of the next.
    """

    offset: int
    num_bytes: int
    payload_checksum: int  # xxh3_64 of the frame's data; equals the header's data checksum

    TYPE: ClassVar[MsgType] = MsgType.CHUNK
    WIRE: ClassVar[Schema] = (
        ("offset", UInt(64)),
        ("num_bytes", UInt(32, lo=1)),
        ("payload_checksum", UInt(64)),
    )


@dataclass(frozen=True, slots=True)
class Commit:
    """Closes the data: the receiver verifies all of it before it reports COMMITTED."""

    total_digest: int  # commit_digest(every chunk), see there
    num_chunks: int
    num_bytes: int
    # The sender's digest of what the KV computes (the worker's canary); b"": none. Opaque to
    # the transfer layer: the decode worker recomputes and compares it before its first token.
    value_digest: bytes = b""

    TYPE: ClassVar[MsgType] = MsgType.COMMIT
    WIRE: ClassVar[Schema] = (
        ("total_digest", UInt(64)),
        ("num_chunks", UInt(32)),
        ("num_bytes", UInt(64)),
        ("value_digest", Bytes(0, MAX_VALUE_DIGEST_BYTES)),
    )


@dataclass(frozen=True, slots=True)
class Ack:
    """A positive reply to a Begin, a Commit or a Renew."""

    of: AckOf

    TYPE: ClassVar[MsgType] = MsgType.ACK
    WIRE: ClassVar[Schema] = (("of", EnumU8(AckOf)),)


@dataclass(frozen=True, slots=True)
class Nack:
    """A refusal; the attempt is over. `text` names the field and the values."""

    code: NackCode
    text: str
    retryable: bool

    TYPE: ClassVar[MsgType] = MsgType.NACK
    WIRE: ClassVar[Schema] = (
        ("code", EnumU8(NackCode)),
        ("text", Str(MAX_TEXT_BYTES)),
        ("retryable", Bool()),
    )


@dataclass(frozen=True, slots=True)
class Renew:
    """Asks the receiver to extend the lease on the blocks reserved for this transfer."""

    lease_id: int
    epoch: int
    ttl: float  # seconds from the receiver's now

    TYPE: ClassVar[MsgType] = MsgType.RENEW
    WIRE: ClassVar[Schema] = (
        ("lease_id", UInt(64)),
        ("epoch", UInt(64)),
        ("ttl", PositiveFloat()),
    )


@dataclass(frozen=True, slots=True)
class Abort:
    """Either side gives the transfer up for good."""

    reason: str

    TYPE: ClassVar[MsgType] = MsgType.ABORT
    WIRE: ClassVar[Schema] = (("reason", Str(MAX_TEXT_BYTES)),)


# Tokens of one Put: its body stays far below the frame's 64 KiB bound.
MAX_PUT_TOKENS = 8192
MAX_OWNER_BYTES = MAX_REQUEST_ID_BYTES
# HMAC-SHA256 tag of a Put under its link's key (`link_session.put_mac`); b"" without a secret.
PUT_AUTH_BYTES = 32


@dataclass(frozen=True, slots=True)
class Put:
    """Checkpoint blocks of `owner` on a replication link; their bytes follow as the data.

    The blocks continue the owner's chain after `parent_hash` (0: from the first block), the
    first covering `first_version` tokens; `token_ids` are whole blocks, so the holder derives
    every block's hash itself and the data is `len(token_ids) / block_size` blocks.
    """

    owner: str
    parent_hash: int
    first_version: int
    token_ids: tuple[int, ...]
    # The owner's lease at the holder is extended by this (a Put is also a renewal).
    lease_ttl: float
    # The writer's digest of what the last block computes (the canary); b"": none.
    value_digest: bytes = b""
    auth: bytes = b""

    TYPE: ClassVar[MsgType] = MsgType.PUT
    WIRE: ClassVar[Schema] = (
        ("owner", Str(MAX_OWNER_BYTES)),
        ("parent_hash", UInt(64)),
        ("first_version", UInt(64, lo=1)),
        ("token_ids", U32Array(1, MAX_PUT_TOKENS)),
        ("lease_ttl", PositiveFloat()),
        ("value_digest", Bytes(0, MAX_VALUE_DIGEST_BYTES)),
        ("auth", Bytes(0, PUT_AUTH_BYTES)),
    )


Message = Hello | Begin | Chunk | Commit | Ack | Nack | Renew | Abort | Put

MESSAGE_TYPES: Mapping[MsgType, type[Message]] = MappingProxyType(
    {cls.TYPE: cls for cls in (Hello, Begin, Chunk, Commit, Ack, Nack, Renew, Abort, Put)}
)
# Messages whose frame carries data after the body (and only these).
DATA_TYPES = frozenset({MsgType.CHUNK, MsgType.PUT})
for _cls in (KVLayout, *MESSAGE_TYPES.values()):
    check_schema(_cls)


def encode_body(message: Message) -> bytes:
    """The body bytes of `message`; ValueError if a field is out of its bounds."""
    out = bytearray()
    write_fields(out, message, message.WIRE, type(message).__name__)
    return bytes(out)


def decode_message(msg_type: MsgType, body: bytes) -> Message:
    """Parse a body of the given type; ProtocolError if it is malformed or has trailing bytes."""
    cls = MESSAGE_TYPES[msg_type]
    reader = Reader(body)
    fields = read_fields(reader, cls.WIRE, cls.__name__)
    if reader.remaining:
        raise ProtocolError(f"{cls.__name__} body has {reader.remaining} trailing bytes")
    try:
        return cls(**fields)
    except ValueError as e:  # a constructor-level check; from a peer it is a protocol error
        raise ProtocolError(f"{cls.__name__}: {e}") from None


def token_digest(token_ids: Sequence[int]) -> bytes:
    """16-byte xxh3_128 of the token ids as little-endian u32 (binds KV to its prompt)."""
    try:
        packed = struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error:
        raise ValueError("token ids must be integers in [0, 2**32)") from None
    return xxhash.xxh3_128_digest(packed)


_CHUNK_RECORD = struct.Struct("<QIQ")


def commit_digest(chunks: Iterable[Chunk]) -> int:
    """The Commit's total digest: xxh3_64 over (offset, num_bytes, payload_checksum) records.

    Records are taken in ascending offset order, so the digest covers all data in order: each
    record's checksum covers its chunk's bytes, and the records pin every chunk's place. Both
    sides compute it from chunk metadata alone, without a second pass over the KV bytes.
    """
    hasher = xxhash.xxh3_64()
    for chunk in sorted(chunks, key=lambda c: c.offset):
        hasher.update(_CHUNK_RECORD.pack(chunk.offset, chunk.num_bytes, chunk.payload_checksum))
    return hasher.intdigest()
