"""Requests waiting for a decode reservation: a bounded FIFO, woken when capacity may be back.

When every decode worker refuses a reservation for lack of room, the request joins the queue
(`NoCapacity` at once if `max_waiting` already wait) and sleeps until told that capacity may
have come back (`notify`): a request of this router ended (its blocks were freed), or a health
poll saw a decode worker's free blocks grow (another router's requests, a lapsed lease). Only
the waiter at the head is woken; if its reservation succeeds it leaves and wakes the next (there
may be more room), if not it keeps its place and sleeps again. So waiters are served in arrival
order, no waiter spins, and nobody polls the workers on a timer. A waiter whose deadline passes
leaves with `TimeoutError`; one that leaves holding a wake-up it never used (its deadline or a
cancel landed just as it was woken) hands it to the new head, so a chance is never lost with it.

Pure asyncio: no I/O, no clock of its own (the caller's deadline, in loop time).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

from pdserve.errors import NoCapacity


class Waiter:
    """One request's place in the queue."""

    __slots__ = ("_event", "_queue")

    def __init__(self, queue: CapacityQueue) -> None:
        self._queue = queue
        self._event = asyncio.Event()

    async def next_chance(self, deadline: float) -> None:
        """Wait until this waiter is at the head and capacity may be back; TimeoutError at
        `deadline` (loop time). A wake-up that came while the caller was busy is kept."""
        async with asyncio.timeout_at(deadline):
            await self._event.wait()
        self._event.clear()

    def pass_on(self) -> None:
        """Give up the chance this waiter was woken for: the next in line gets it once this
        one leaves the queue."""
        self._event.set()

    def _wake(self) -> None:
        self._event.set()

    def _unused_wakeup(self) -> bool:
        return self._event.is_set()


class CapacityQueue:
    """FIFO of waiters for decode capacity."""

    def __init__(self, max_waiting: int) -> None:
        self._max_waiting = max_waiting
        self._waiters: deque[Waiter] = deque()
        self.num_notified = 0

    @property
    def num_waiting(self) -> int:
        """Requests waiting now."""
        return len(self._waiters)

    def notify(self) -> None:
        """Capacity may be back: wake the waiter at the head (if any)."""
        self.num_notified += 1
        if self._waiters:
            self._waiters[0]._wake()

    @contextlib.asynccontextmanager
    async def join(self, detail: str) -> AsyncIterator[Waiter]:
        """Wait in line; NoCapacity (with `detail`) when the queue is full. Leaving after a
        success should be followed by `notify()`, so the next waiter tries too."""
        if len(self._waiters) >= self._max_waiting:
            raise NoCapacity(f"{detail}; {len(self._waiters)} requests already wait")
        waiter = Waiter(self)
        self._waiters.append(waiter)
        try:
            yield waiter
        finally:
            self._waiters.remove(waiter)
            if waiter._unused_wakeup():
                self.notify()

    def is_head(self, waiter: Waiter) -> bool:
        """Whether `waiter` is first in line."""
        return bool(self._waiters) and self._waiters[0] is waiter
