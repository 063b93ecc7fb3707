"""KV events: what a block manager's prefix cache gained and lost, numbered for subscribers.

The block manager appends one `KVEvent` per change of its prefix cache: `stored` (full blocks
whose KV is computed and verified got a chained hash: `BlockManager.cache_blocks`), `evicted`
(cached blocks reused for other KV: `allocate_slots` popping them off the free queue) and
`cleared` (`reset_prefix_cache`). Hashes are the engine's chained xxh3 block hashes, so a
subscriber that applies every event in order holds exactly the set of hashes the engine can
reuse, with no other knowledge of the engine.

Sequence numbers start at 1 and grow by one per event; `last_seq` is 0 before any. A log keeps
the last `capacity` events: `since(seq)` answers every event after `seq`, or None when some of
them were already dropped (a gap: the subscriber must start again from a snapshot of the whole
cache, taken on the engine thread together with `last_seq`). `epoch` names one log, so one
engine's life: a subscriber that sees another epoch knows the process restarted and its cache
is empty.

Thread-safe: appended on the engine thread, read by the worker's HTTP handlers. `on_append` is
called after each append, outside the lock (the worker wakes its event streams there). Pure
otherwise: no I/O, no asyncio.
"""

from __future__ import annotations

import enum
import secrets
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

DEFAULT_CAPACITY = 4096


class KVEventKind(enum.StrEnum):
    """What happened to the prefix cache."""

    STORED = "stored"
    EVICTED = "evicted"
    CLEARED = "cleared"


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One change of the prefix cache."""

    seq: int
    kind: KVEventKind
    # Chained block hashes, in the order they were stored or evicted; empty for `cleared`.
    block_hashes: tuple[int, ...]


class KVEventLog:
    """The last `capacity` events of one engine's prefix cache, numbered from 1."""

    def __init__(
        self, capacity: int = DEFAULT_CAPACITY, on_append: Callable[[], None] | None = None
    ) -> None:
        if capacity < 1:
            raise ValueError(f"KVEventLog: capacity must be >= 1, got {capacity}")
        self.epoch = secrets.token_hex(8)
        self.on_append = on_append
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._last_seq = 0
        self._lock = threading.Lock()

    @property
    def last_seq(self) -> int:
        """The newest event's number (0 before any)."""
        with self._lock:
            return self._last_seq

    def append(self, kind: KVEventKind, block_hashes: Iterable[int] = ()) -> None:
        """Record one change; a stored or evicted event without hashes is not recorded."""
        hashes = tuple(block_hashes)
        if not hashes and kind is not KVEventKind.CLEARED:
            return
        with self._lock:
            self._last_seq += 1
            self._events.append(KVEvent(self._last_seq, kind, hashes))
        if self.on_append is not None:
            self.on_append()

    def since(self, seq: int) -> list[KVEvent] | None:
        """Every event numbered after `seq`, oldest first; None if some were dropped."""
        with self._lock:
            if seq >= self._last_seq:
                return []
            oldest = self._events[0].seq if self._events else self._last_seq + 1
            if seq + 1 < oldest:
                return None
            return [e for e in self._events if e.seq > seq]
