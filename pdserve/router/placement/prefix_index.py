"""The router's prefix index: which KV blocks each worker has cached. Pure.

Keys are the engine's chained block hashes (`engine.block_manager.prefix_block_hashes`:
xxh3 over the parent hash and the block's token ids, deterministic across processes), so a
hash names a whole prefix and the router computes the same keys a worker's block manager uses.

**Fed by the workers' KV events** (`engine/kv_events.py`, streamed by POST /kv_events and
followed by `router/workers/kv_feed.py`). A worker's entries are then exactly its block manager's
cached hashes: a `snapshot` replaces them, `stored` adds, `evicted` removes, `cleared` empties.
Every router that follows the same workers holds the same index, so two routers place a
request alike, and an evicted block stops attracting requests as soon as its event arrives.
Events apply strictly in order: `apply` refuses (returns False, changing nothing) an event of
another epoch or one that does not follow the last applied number; the feed then asks the
worker for a fresh snapshot. While a feed is reconnecting, the entries stay as they were and
the missed events are replayed on reconnection (same epoch, numbers the worker still has).

**Inferred from what the router routed**, for a worker that never delivered a snapshot (a
worker without KV events, e.g. a test double): `insert` records the prefix the router sent it
(the prompt a prefill worker computed, the prompt plus generated tokens a decode worker
computed), in an LRU capped at the worker's `num_blocks`, inserted in the order the engine
frees blocks (a request's last block first), and a worker that restarted (a new incarnation:
worker id and pid) starts empty. `insert` changes nothing for a fed worker: its events are the
truth, and an inferred hash the worker never stored would never be evicted.

Invariants: `match` counts leading hashes only (a chained hash present without its parent
counts for nothing, exactly like the engine's lookup); an inferred worker holds at most
`capacity` hashes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import xxhash

from pdserve.protocol.worker_observe import KVEventBatch


@dataclass(frozen=True, slots=True)
class FeedPosition:
    """Where a worker's event stream was last applied: its epoch and event number."""

    epoch: str
    seq: int


@dataclass(frozen=True, slots=True)
class WorkerIndexView:
    """One worker's entries, summarized (GET /debug/kv_index)."""

    url: str
    # Whether the entries come from the worker's KV events (else: inferred from routing).
    fed: bool
    epoch: str | None
    seq: int | None
    num_blocks: int
    # xxh3 over the sorted hashes: two routers agree on a worker when their digests match.
    digest: str


class PrefixIndex:
    """Per-worker sets of cached block hashes."""

    def __init__(self) -> None:
        # worker url -> hashes; for an inferred worker in eviction order (head evicted first).
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._incarnation: dict[str, str] = {}
        # Workers whose entries come from KV events, and where their stream stands.
        self._fed: dict[str, FeedPosition] = {}

    # ---- KV events --------------------------------------------------------------------------

    def position(self, worker: str) -> FeedPosition | None:
        """Where `worker`'s events were last applied (None: never, resume from a snapshot)."""
        return self._fed.get(worker)

    def is_fed(self, worker: str) -> bool:
        """Whether `worker`'s entries come from its KV events."""
        return worker in self._fed

    def apply(self, worker: str, batch: KVEventBatch) -> bool:
        """Apply one line of `worker`'s event stream; False (nothing changed) when it does not
        follow what was applied (another epoch, a missed number): resync from a snapshot."""
        if batch.kind == "snapshot":
            self._blocks[worker] = OrderedDict.fromkeys(batch.block_hashes)
            self._fed[worker] = FeedPosition(batch.epoch, batch.seq)
            return True
        at = self._fed.get(worker)
        if at is None or at.epoch != batch.epoch:
            return False
        if batch.kind == "heartbeat":
            return batch.seq == at.seq
        if batch.seq != at.seq + 1:
            return False
        blocks = self._blocks.setdefault(worker, OrderedDict())
        if batch.kind == "stored":
            for h in batch.block_hashes:
                blocks[h] = None
        elif batch.kind == "evicted":
            for h in batch.block_hashes:
                blocks.pop(h, None)
        else:  # cleared
            blocks.clear()
        self._fed[worker] = FeedPosition(at.epoch, batch.seq)
        return True

    # ---- inferred from routing ------------------------------------------------------------

    def observe(self, worker: str, incarnation: str) -> None:
        """Note the worker process now answering at `worker`; a new one starts empty (for an
        inferred worker: a fed one's restart shows as a new epoch in its events)."""
        previous = self._incarnation.get(worker)
        if previous not in (None, incarnation) and worker not in self._fed:
            self._blocks.pop(worker, None)
        self._incarnation[worker] = incarnation

    def insert(self, worker: str, block_hashes: Sequence[int], capacity: int) -> None:
        """Record that `worker` computed (and so caches) the prefix `block_hashes` (no-op for
        a fed worker).

        The last block is made least recent and the first most recent, the order in which the
        engine frees a finished request's blocks, then the oldest entries beyond `capacity`
        are dropped.
        """
        if worker in self._fed:
            return
        blocks = self._blocks.setdefault(worker, OrderedDict())
        for h in reversed(block_hashes):
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > max(capacity, 0):
            blocks.popitem(last=False)

    # ---- queries ----------------------------------------------------------------------------

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
        self._fed.pop(worker, None)

    def retain(self, workers: Collection[str]) -> None:
        """Forget every worker not in `workers` (they left the pool)."""
        for worker in {*self._blocks, *self._incarnation, *self._fed} - set(workers):
            self.remove(worker)

    def num_blocks(self, worker: str) -> int:
        """Entries held for `worker`."""
        return len(self._blocks.get(worker, ()))

    def lru_order(self, worker: str) -> list[int]:
        """The worker's hashes in eviction order (for tests)."""
        return list(self._blocks.get(worker, ()))

    def view(self, worker: str) -> WorkerIndexView:
        """`worker`'s entries summarized, with a digest to compare across routers."""
        hashes = sorted(self._blocks.get(worker, ()))
        digest = xxhash.xxh3_64(b"".join(h.to_bytes(8, "little") for h in hashes)).hexdigest()
        at = self._fed.get(worker)
        return WorkerIndexView(
            worker,
            at is not None,
            at.epoch if at else None,
            at.seq if at else None,
            len(hashes),
            digest,
        )
