"""The worker's leases: one `LeaseTable` on the monotonic clock, and the reaper that expires it.

Every KV block this worker holds for another party is under a lease granted here (invariant 1):
a decode reservation's blocks awaiting a transfer, and a prefill's held KV while it is sent.
Each grant comes with an `on_expire` callback. The reaper wakes every `interval_s`, calls
`LeaseTable.expire()` and runs the callbacks of the leases it ended: that is where the owner
frees the blocks (abort the reservation, cancel the send). A lease that ends by `drop` (the
holder finished) never runs its callback. Everything runs on the event loop's thread.

It knows leases, time and callbacks; not engines, blocks or HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence

from pdserve.clock import Clock, MonotonicClock
from pdserve.errors import LeaseError, LeaseExpired
from pdserve.tasks import cancel_and_wait
from pdserve.transfer.lease import LeaseTable
from pdserve.transfer.sender import LeaseHandle

logger = logging.getLogger(__name__)


class LeaseKeeper:
    """Grants leases with an expiry callback and runs a periodic reaper."""

    def __init__(self, interval_s: float = 0.5, clock: Clock | None = None) -> None:
        self.clock = clock or MonotonicClock()
        self.table = LeaseTable(self.clock)
        self.interval_s = interval_s
        self._on_expire: dict[int, Callable[[], object]] = {}
        self._task: asyncio.Task[None] | None = None
        # Expiries by what the lease held: the first word of its holder ("prefill",
        # "reservation"), a bounded label for metrics.
        self.expired_by_kind: Counter[str] = Counter()

    def grant(
        self,
        resource_ids: Sequence[int],
        ttl_s: float,
        holder: str,
        on_expire: Callable[[], object],
    ) -> LeaseHandle:
        """Lease `resource_ids` for `ttl_s`; `on_expire` runs if the reaper ends the lease.

        Blocks already under another lease (a prefix block shared by two requests) are left
        out: a block is under at most one lease, and the first one keeps it pinned.
        """
        free_ids = [rid for rid in resource_ids if self.table.lease_of(rid) is None]
        lease = self.table.grant(free_ids, ttl_s, holder)
        self._on_expire[lease.lease_id] = on_expire
        return LeaseHandle(self.table, lease.lease_id, lease.epoch, ttl_s)

    def check(self, handle: LeaseHandle) -> None:
        """Raise LeaseError unless the lease is live (the receiver's guard)."""
        self.table.check(handle.lease_id, handle.epoch)

    def drop(self, handle: LeaseHandle | None) -> None:
        """End a lease whose holder is done (already released or expired is fine)."""
        if handle is None:
            return
        self._on_expire.pop(handle.lease_id, None)
        try:
            self.table.release(handle.lease_id, handle.epoch)
        except LeaseExpired:
            # Past its deadline and not yet swept: the table refuses a release then, so sweep
            # now. Left live, its blocks would stay leased to nobody until the next sweep, and a
            # grant meanwhile would leave them out of the next holder's lease.
            self.reap()
        except LeaseError:
            pass  # released or expired already

    def reap(self) -> int:
        """Expire due leases and run their callbacks; returns how many expired."""
        expired = self.table.expire()
        for lease in expired:
            self.expired_by_kind[lease.holder.split(" ", 1)[0] or "unknown"] += 1
            callback = self._on_expire.pop(lease.lease_id, None)
            if callback is None:
                continue
            try:
                callback()
            except Exception:
                logger.exception("on_expire of lease %d (%s) failed", lease.lease_id, lease.holder)
        return len(expired)

    @property
    def num_active(self) -> int:
        """Leases granted and not yet ended."""
        return self.table.num_active

    @property
    def num_expired_total(self) -> int:
        """Leases ended by expiry since start."""
        return self.table.num_expired_total

    def start(self) -> None:
        """Start the reaper task on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._reap_forever())

    async def aclose(self) -> None:
        """Stop the reaper (idempotent)."""
        await cancel_and_wait(self._task)
        self._task = None

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.reap()
