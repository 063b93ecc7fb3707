"""The host-memory checkpoint tier of one worker: a bounded `CheckpointHolder`.

Blocks live in host memory (one bytearray each), keyed by chained hash, shared between owners
that put the same prefix (two requests with one prompt hold its blocks once). Room is counted
in bytes: blocks held plus blocks reserved by puts whose bytes are still arriving never exceed
`capacity_bytes`; a put that does not fit is refused ("full") before anything travels, and the
writer goes on without a checkpoint.

Invariants (`check_invariants`, called by the tests after every operation):
- `used_bytes` is the size of the held blocks, `reserved_bytes` that of the open puts, and
  their sum is at most the capacity.
- A block is held while at least one owner holds it; `release` of its last owner frees it.
- A block read back has the version, fingerprint and bytes it arrived with; one whose bytes
  changed is refused ("checksum") and dropped, never handed out.

Pure bookkeeping over bytes: no sockets, no clocks, no engine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from pdserve.checkpoint.holder import BlockKey, BlockRun, PrefixHit, Refusal
from pdserve.engine.block_manager import hash_block_tokens
from pdserve.errors import CheckpointRefused, ConfigError

_ROOT_HASH = 0


def _checksum(data: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


@dataclass(slots=True)
class _Entry:
    data: bytearray
    version: int
    fingerprint: str
    checksum: int
    owners: set[str] = field(default_factory=set)
    # The writer's value digest of this block's last position (`engine/canary.py`; only the
    # last block of a put carries one): b"" when none.
    value_digest: bytes = b""


@dataclass(slots=True)
class HostPut:
    """A put whose bytes are arriving into `buffers` (one per key, block_bytes each)."""

    owner: str
    fingerprint: str
    keys: tuple[BlockKey, ...]
    buffers: tuple[memoryview, ...]
    num_bytes: int
    done: bool = False


class HostTier:
    """Checkpoint blocks in this process's memory, at most `capacity_bytes` of them."""

    def __init__(self, capacity_bytes: int, block_size: int, block_bytes: int) -> None:
        if capacity_bytes < 0 or block_size < 1 or block_bytes < 1:
            raise ConfigError(
                f"checkpoint tier: capacity_bytes={capacity_bytes} block_size={block_size}"
                f" block_bytes={block_bytes}"
            )
        self.capacity_bytes = capacity_bytes
        self.block_size = block_size
        self.block_bytes = block_bytes
        self._entries: dict[int, _Entry] = {}
        self._owned: dict[str, set[int]] = {}
        self.used_bytes = 0
        self.reserved_bytes = 0
        # Refusals by `Refusal` value (puts and reads): the metric's labels.
        self.refused: Counter[str] = Counter()
        self.num_blocks_put = 0
        self.num_blocks_read = 0

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks held (each counted once, however many owners hold it)."""
        return len(self._entries)

    @property
    def num_owners(self) -> int:
        return len(self._owned)

    def owned(self, owner: str) -> int:
        """Blocks the owner holds."""
        return len(self._owned.get(owner, ()))

    # ---- puts ----------------------------------------------------------------------------

    def _refuse(self, reason: Refusal, message: str) -> CheckpointRefused:
        self.refused[reason.value] += 1
        return CheckpointRefused(reason.value, message)

    def begin_put(self, run: BlockRun) -> HostPut:
        """`CheckpointHolder.begin_put` in host memory: the blocks' room is allocated here."""
        owner, fingerprint, parent_hash = run.owner, run.fingerprint, run.parent_hash
        first_version, block_tokens = run.first_version, run.block_tokens
        bs = self.block_size
        where = f"checkpoint put of {owner}"
        if first_version < bs or first_version % bs or not block_tokens:
            raise self._refuse(
                Refusal.VERSION,
                f"{where}: first_version {first_version} is not a positive multiple of the"
                f" block size {bs}, or no blocks",
            )
        if any(len(tokens) != bs for tokens in block_tokens):
            raise self._refuse(Refusal.VERSION, f"{where}: a block does not hold {bs} tokens")
        if first_version == bs:
            if parent_hash != _ROOT_HASH:
                raise self._refuse(Refusal.CHAIN, f"{where}: the first block has a parent")
        else:
            parent = self._entries.get(parent_hash)
            if (
                parent is None
                or parent.version != first_version - bs
                or parent.fingerprint != fingerprint
            ):
                raise self._refuse(
                    Refusal.CHAIN,
                    f"{where}: parent {parent_hash:#x} (version {first_version - bs}) not held",
                )
        num_bytes = len(block_tokens) * self.block_bytes
        free = self.capacity_bytes - self.used_bytes - self.reserved_bytes
        if num_bytes > free:
            raise self._refuse(
                Refusal.FULL, f"{where}: {num_bytes} bytes asked, {max(free, 0)} free"
            )
        keys: list[BlockKey] = []
        h = parent_hash
        for i, tokens in enumerate(block_tokens):
            h = hash_block_tokens(h, list(tokens))
            keys.append(BlockKey(h, first_version + i * bs))
        self.reserved_bytes += num_bytes
        buffers = tuple(memoryview(bytearray(self.block_bytes)) for _ in keys)
        return HostPut(owner, fingerprint, tuple(keys), buffers, num_bytes)

    def commit(self, pending: HostPut, value_digest: bytes = b"") -> int:
        """The bytes arrived verified: hold them (the value digest, if any, on the last
        block); returns blocks now held for the owner."""
        if pending.done:
            return self.owned(pending.owner)
        pending.done = True
        self.reserved_bytes -= pending.num_bytes
        owned = self._owned.setdefault(pending.owner, set())
        for key, buffer in zip(pending.keys, pending.buffers, strict=True):
            entry = self._entries.get(key.block_hash)
            if entry is None:
                data = buffer.obj
                assert isinstance(data, bytearray)
                entry = _Entry(data, key.version, pending.fingerprint, _checksum(data))
                self._entries[key.block_hash] = entry
                self.used_bytes += len(data)
            entry.owners.add(pending.owner)
            owned.add(key.block_hash)
        last = self._entries.get(pending.keys[-1].block_hash)
        if last is not None and value_digest:
            last.value_digest = value_digest
        self.num_blocks_put += len(pending.keys)
        return len(owned)

    def abort(self, pending: HostPut) -> None:
        """The bytes will not arrive: give the room back (idempotent)."""
        if not pending.done:
            pending.done = True
            self.reserved_bytes -= pending.num_bytes

    # ---- gets ----------------------------------------------------------------------------

    def _check(self, i: int, block_hash: int, fingerprint: str) -> _Entry | CheckpointRefused:
        """The entry for position i, or why it cannot serve."""
        entry = self._entries.get(block_hash)
        if entry is None:
            return CheckpointRefused(Refusal.MISSING.value, f"block {i} ({block_hash:#x})")
        if entry.fingerprint != fingerprint:
            return self._refuse(
                Refusal.FINGERPRINT,
                f"block {i} ({block_hash:#x}): fingerprint {entry.fingerprint}, want {fingerprint}",
            )
        want = (i + 1) * self.block_size
        if entry.version != want:
            return self._refuse(
                Refusal.VERSION,
                f"block {i} ({block_hash:#x}): version {entry.version}, want {want}",
            )
        return entry

    def longest_prefix(self, block_hashes: Sequence[int], fingerprint: str) -> PrefixHit:
        """How many leading blocks of `block_hashes` are held, valid for `fingerprint`
        (a block that is held but invalid ends the prefix and is counted as refused)."""
        n = 0
        for i, h in enumerate(block_hashes):
            if isinstance(self._check(i, h, fingerprint), CheckpointRefused):
                break
            n += 1
        return PrefixHit(n, n * self.block_size)

    def read(self, block_hashes: Sequence[int], fingerprint: str) -> list[memoryview]:
        """The held bytes of the leading blocks `block_hashes`, each checked (version,
        fingerprint, checksum); CheckpointRefused names the first bad one. A block whose
        bytes changed is dropped."""
        views: list[memoryview] = []
        for i, h in enumerate(block_hashes):
            entry = self._check(i, h, fingerprint)
            if isinstance(entry, CheckpointRefused):
                if entry.reason == Refusal.MISSING.value:
                    self.refused[Refusal.MISSING.value] += 1
                raise entry
            if _checksum(entry.data) != entry.checksum:
                self._drop(h)
                raise self._refuse(
                    Refusal.CHECKSUM, f"block {i} ({h:#x}): bytes changed since they arrived"
                )
            views.append(memoryview(entry.data).toreadonly())
        self.num_blocks_read += len(views)
        return views

    def value_digest(self, block_hash: int) -> bytes:
        """The value digest held with a block (b"": none, or not held)."""
        entry = self._entries.get(block_hash)
        return b"" if entry is None else entry.value_digest

    def adopt(self, owner: str, block_hashes: Sequence[int]) -> int:
        """`owner` holds the held blocks of `block_hashes` too (a resumed request takes its
        checkpoint over); returns blocks it now holds."""
        owned = self._owned.setdefault(owner, set())
        for h in block_hashes:
            entry = self._entries.get(h)
            if entry is not None:
                entry.owners.add(owner)
                owned.add(h)
        return len(owned)

    # ---- release -------------------------------------------------------------------------

    def release(self, owner: str) -> int:
        """Drop the owner's hold; returns blocks freed (held by no owner any more)."""
        num_freed = 0
        for h in self._owned.pop(owner, set()):
            entry = self._entries.get(h)
            if entry is None:
                continue
            entry.owners.discard(owner)
            if not entry.owners:
                self._drop(h)
                num_freed += 1
        return num_freed

    def _drop(self, block_hash: int) -> None:
        entry = self._entries.pop(block_hash)
        self.used_bytes -= len(entry.data)
        for owner in entry.owners:
            held = self._owned.get(owner)
            if held is not None:
                held.discard(block_hash)

    def check_invariants(self) -> None:
        """Raise AssertionError if the accounting is inconsistent (tests)."""
        used = sum(len(e.data) for e in self._entries.values())
        assert used == self.used_bytes, (used, self.used_bytes)
        assert self.reserved_bytes >= 0
        assert self.used_bytes + self.reserved_bytes <= self.capacity_bytes
        for h, entry in self._entries.items():
            assert entry.owners, f"block {h:#x} held by nobody"
            for owner in entry.owners:
                assert h in self._owned.get(owner, set()), (owner, h)
        for owner, hashes in self._owned.items():
            for h in hashes:
                assert owner in self._entries[h].owners, (owner, h)
