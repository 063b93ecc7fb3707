"""Graceful drain: take nothing new, finish what is held, leave the membership, then stop.

`Worker.drain` (on SIGTERM, or `POST /admin/drain`) runs these steps:
1. **Say so, then refuse new work.** /health says `draining` at once, so routers choose the
   worker for nothing new; once a router has read it (the first /health answered while
   draining, then `SEEN_GRACE_S` for the calls it placed before reading it; or `SEEN_WAIT_S`
   without one, idle or not: a router that chose the worker a moment earlier still sends
   there, and a worker that refused or left at once would cost that request a retry), /reserve,
   /prefill and /generate answer 503 `Draining` (retryable: a router that raced the flag goes
   to another worker). Calls already admitted go on: a /decode for a reservation made before,
   a stream, a KV transfer, lease renewals.
2. **Leave the membership** then: a router that sees a draining worker leave lets its open
   calls finish instead of cutting them.
3. **Finish.** Wait until nothing is held (`held`: requests in the engine, requests admitted
   by the HTTP layer, KV blocks pinned for a transfer or a reservation, KV leases), within the
   drain timeout.
4. The caller stops the worker. Whatever the timeout left is cut as a crash would cut it: the
   router migrates the streams (from their decode checkpoints where enabled) and prefills the
   rest again; nothing is lost, some of it is recomputed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

# How long the drain waits for a router to read the `draining` flag before leaving the
# membership (a router polls every second; a worker nobody polls leaves after this).
SEEN_WAIT_S = 2.0
# After a router read the flag: calls it placed just before still arrive (a request's /prefill
# follows its choice by a reservation round trip); they are taken and finished.
SEEN_GRACE_S = 0.25
POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class DrainReport:
    """How a drain ended: drained (nothing held) or timed out, and what was left."""

    drained: bool
    waited_s: float
    left: Mapping[str, int]


def held_total(held: Mapping[str, int]) -> int:
    """Everything still held, summed (0: drained)."""
    return sum(held.values())


async def wait_until_idle(
    held: Callable[[], Awaitable[Mapping[str, int]]],
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> DrainReport:
    """Poll `held` until it is all zero or `timeout_s` passed."""
    start = clock()
    while True:
        now_held = await held()
        waited = clock() - start
        if held_total(now_held) == 0:
            return DrainReport(True, waited, now_held)
        if waited >= timeout_s:
            return DrainReport(False, waited, now_held)
        await asyncio.sleep(POLL_S)
