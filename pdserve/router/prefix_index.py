"""The router's prefix index: which KV blocks each worker probably still has cached. Pure.

Keys are the engine's chained block hashes (`engine.block_manager.prefix_block_hashes`:
xxh3 over the parent hash and the block's token ids, deterministic across processes), so a
hash names a whole prefix and the router computes the same keys a worker's block manager uses.

**Why the router builds it from what it routed, not from worker KV events.** The router is the
only party that places work, so it already knows every prefix it sent to every worker: the
prompt a prefill worker computed, the prompt plus generated tokens a decode worker computed. A
worker event stream (stored/evicted with sequence numbers, gap detection and resync) would add a
second channel, a subscription per worker and a resync protocol, only to learn about evictions.
Evictions are the one thing this index cannot see, and they are harmless here: the index only
ranks candidates, and the worker's own answer is the truth that decides what is computed and
sent (a reservation reports `num_cached_tokens`; a prefill reuses whatever its block manager
still holds). A stale entry costs at worst a worse placement, never a wrong result. To keep
staleness bounded, each worker's entries are an LRU capped at that worker's `num_blocks`
(inserted in the order the engine frees them: a request's last block first), which mirrors the
engine's own LRU eviction; entries of a worker that restarted (a new incarnation: worker id and
pid) are dropped.

Invariants: per worker, at most `capacity` hashes; `match` counts leading hashes only (a chained
hash present without its parent counts for nothing, exactly like the engine's lookup).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence


class PrefixIndex:
    """Per-worker LRU sets of cached block hashes."""

    def __init__(self) -> None:
        # worker url -> hashes in eviction order (head evicted first).
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._incarnation: dict[str, str] = {}

    def observe(self, worker: str, incarnation: str) -> None:
        """Note the worker process now answering at `worker`; a new one starts empty."""
        if self._incarnation.get(worker) not in (None, incarnation):
            self._blocks.pop(worker, None)
        self._incarnation[worker] = incarnation

    def insert(self, worker: str, block_hashes: Sequence[int], capacity: int) -> None:
        """Record that `worker` computed (and so caches) the prefix `block_hashes`.

        The last block is made least recent and the first most recent, the order in which the
        engine frees a finished request's blocks, then the oldest entries beyond `capacity`
        are dropped.
        """
        blocks = self._blocks.setdefault(worker, OrderedDict())
        for h in reversed(block_hashes):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > max(capacity, 0):
            blocks.popitem(last=False)

    def match(self, worker: str, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of `block_hashes` the worker holds (0 if unknown)."""
        blocks = self._blocks.get(worker)
        if not blocks:
            return 0
        n = 0
        for h in block_hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def remove(self, worker: str) -> None:
        """Forget everything about `worker`."""
        self._blocks.pop(worker, None)
        self._incarnation.pop(worker, None)

    def retain(self, workers: Collection[str]) -> None:
        """Forget every worker not in `workers` (they left the pool)."""
        for worker in {*self._blocks, *self._incarnation} - set(workers):
            self.remove(worker)

    def num_blocks(self, worker: str) -> int:
        """Entries held for `worker`."""
        return len(self._blocks.get(worker, ()))

    def lru_order(self, worker: str) -> list[int]:
        """The worker's hashes in eviction order (for tests)."""
        return list(self._blocks.get(worker, ()))
