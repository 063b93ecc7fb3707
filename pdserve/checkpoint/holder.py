"""The checkpoint holder interface: put KV blocks by chained hash under a lease, get the
longest present prefix.

A decode worker replicates a decoding request's full KV blocks to a holder; a migration asks
the holder how much of the request's token prefix it holds and pulls those blocks. Keys are the
engine's chained prefix hashes (`engine.block_manager.hash_block_tokens`): hash(block i) covers
every token up to the end of block i, so a key names a whole prefix, never one block alone,
and a lookup is a walk over the request's hashes that stops at the first missing one.

Every block carries a version (the number of tokens its prefix covers: (i + 1) * block_size),
the fingerprint digest of the engine that computed it and a checksum of its bytes taken when it
arrived; a read checks all three and refuses (`CheckpointRefused`, counted by reason) a block
whose version, fingerprint or bytes do not match. A put belongs to an owner (the request) whose
lease the writer renews; releasing the owner (the request ended) or its lease lapsing (the
writer died) drops what only it held.

This is the interface a shared KV store exposes, so one can take the host tier's place:

| here                               | Mooncake Store                   | LMCache                         |
| ---------------------------------- | -------------------------------- | ------------------------------- |
| key: chained block hash            | object key (hash of the prefix)  | CacheEngineKey: prefix chunk    |
|                                    |                                  | hash + model + format           |
| `begin_put` + `commit`             | `put` / `batch_put` (immutable   | `batched_put` of memory objects |
|                                    | once written)                    |                                 |
| `longest_prefix`                   | `batch_is_exist` over the keys,  | `lookup` / `contains`: prefix   |
|                                    | stop at the first miss           | length found                    |
| `read`                             | `get` / `batch_get`              | `get` / `batched_get`           |
| owner lease (renewed, released)    | object lease / `remove` on       | eviction policy + pin on        |
|                                    | release                          | retrieve                        |
| fingerprint, version, checksum     | in the key or object metadata    | fmt / model in the key          |

Pure: no sockets, no clocks (the worker's lease keeper times the owner leases).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Refusal(enum.Enum):
    """Why a holder refused a checkpoint (a bounded metric label)."""

    FULL = "full"  # the tier has no room for the put
    VERSION = "version"  # the block's version is not the one its position implies
    FINGERPRINT = "fingerprint"  # computed by an engine whose KV is not interchangeable
    CHECKSUM = "checksum"  # its bytes changed since they arrived
    CHAIN = "chain"  # the put does not continue a prefix the holder has
    MISSING = "missing"  # a block asked for is not held (released, expired, never put)


@dataclass(frozen=True, slots=True)
class BlockKey:
    """One block of a put: its chained hash and the tokens it covers."""

    block_hash: int
    # Tokens covered by the prefix ending with this block: (index + 1) * block_size.
    version: int


@dataclass(frozen=True, slots=True)
class BlockRun:
    """Full blocks to put for an owner: they continue the chain after `parent_hash` (0: the
    request's first block), and the first of them covers `first_version` tokens."""

    owner: str
    # The digest of the engine that computed them (a read from another engine is refused).
    fingerprint: str
    parent_hash: int
    first_version: int
    block_tokens: Sequence[Sequence[int]]


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """What a lookup found: the longest held prefix of the asked hashes."""

    num_blocks: int
    # Tokens that prefix covers (0 when nothing is held).
    version: int


class PendingPut(Protocol):
    """A put whose bytes are arriving; `buffers` are where they land (one per block)."""

    @property
    def owner(self) -> str: ...

    @property
    def keys(self) -> Sequence[BlockKey]: ...

    @property
    def buffers(self) -> Sequence[memoryview]: ...


class CheckpointHolder(Protocol):
    """Put blocks by chained hash under an owner's lease; get the longest present prefix."""

    def begin_put(self, run: BlockRun) -> PendingPut:
        """Room for the run's blocks; CheckpointRefused (full, chain, version) before any byte
        travels."""
        ...

    def commit(self, pending: PendingPut) -> int:
        """The bytes arrived verified: hold them; returns blocks now held for the owner."""
        ...

    def abort(self, pending: PendingPut) -> None:
        """The bytes will not arrive: give the room back."""
        ...

    def longest_prefix(self, block_hashes: Sequence[int], fingerprint: str) -> PrefixHit:
        """How many leading blocks of `block_hashes` are held, valid for `fingerprint`."""
        ...

    def read(self, block_hashes: Sequence[int], fingerprint: str) -> list[memoryview]:
        """The held bytes of those blocks, each checked; CheckpointRefused names the first
        bad one."""
        ...

    def release(self, owner: str) -> int:
        """Drop the owner's hold (request ended, lease lapsed); returns blocks freed."""
        ...
