"""`LeaseTable`: time-bounded, fenced holds on resources (KV block ids) for another party.

The same table serves the prefill side (blocks held until the transfer is acknowledged) and
the decode side (blocks reserved until the transfer commits). Life cycle of a lease:

    grant → (renew)* → release          the holder is done: resources returned by `release`
                     → expire           the deadline passed: resources returned by `expire`

Invariants:
- A resource is under at most one lease at a time; `grant` refuses a held resource (LeaseError)
  until it is returned, even if its lease's deadline has passed but `expire` has not yet run.
- Every granted resource is returned exactly once: by the `release` that succeeds, or by the
  `expire` that reports the lease, never both.
- Fencing: each grant gets a fresh epoch, strictly increasing per table (start it above any
  epoch of an earlier incarnation with `first_epoch`; renew keeps the epoch). An operation
  must present (lease_id, epoch); `check` refuses a lapsed grant (LeaseExpired) and an old or
  foreign epoch, a released lease, or a grant whose resources a newer epoch now holds
  (StaleLease). So blocks freed by expiry can never be reached through the old grant.
- A lease is live while `now < deadline`; time comes only from the injected clock.

It knows resource ids and time: not what the resources are, transfers, sockets or schedulers.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pdserve.clock import Clock
from pdserve.errors import LeaseError, LeaseExpired, StaleLease


@dataclass(frozen=True, slots=True)
class Lease:
    """One grant. `epoch` is its fencing token; `deadline` is in clock seconds."""

    lease_id: int
    epoch: int
    holder: str
    resource_ids: tuple[int, ...]
    deadline: float


class LeaseTable:
    """Grants, renewals, releases and expiry of leases over integer resource ids."""

    def __init__(self, clock: Clock, *, first_epoch: int = 1, history: int = 4096) -> None:
        """`history` bounds how many ended leases `check` can still describe precisely."""
        self._clock = clock
        self._next_lease_id = 1
        self._next_epoch = first_epoch
        self._live: dict[int, Lease] = {}
        self._holder_of: dict[int, int] = {}  # resource id -> live lease id
        self._epoch_of: dict[int, int] = {}  # resource id -> epoch of its latest grant
        self._deadlines: list[tuple[float, int]] = []  # heap; entries go stale on renew
        self._ended: OrderedDict[int, tuple[Lease, bool]] = OrderedDict()  # id -> (lease, expired)
        self._history = history
        self.num_granted_total = 0
        self.num_released_total = 0
        self.num_expired_total = 0

    # ---- the verbs ---------------------------------------------------------------------------

    def grant(self, resource_ids: Sequence[int], ttl: float, holder: str) -> Lease:
        """Lease `resource_ids` to `holder` for `ttl` seconds; LeaseError if any is held."""
        ids = tuple(resource_ids)
        _check_ttl(ttl)
        if len(set(ids)) != len(ids):
            raise ValueError(f"grant to {holder}: duplicate resource ids in {list(ids)}")
        for rid in ids:
            if rid in self._holder_of:
                owner = self._live[self._holder_of[rid]]
                raise LeaseError(
                    f"grant to {holder}: resource {rid} is under lease {owner.lease_id} "
                    f"(epoch {owner.epoch}, holder {owner.holder})"
                )
        lease = Lease(self._next_lease_id, self._next_epoch, holder, ids, self._clock.now() + ttl)
        self._next_lease_id += 1
        self._next_epoch += 1
        self._live[lease.lease_id] = lease
        for rid in ids:
            self._holder_of[rid] = lease.lease_id
            self._epoch_of[rid] = lease.epoch
        heapq.heappush(self._deadlines, (lease.deadline, lease.lease_id))
        self.num_granted_total += 1
        return lease

    def renew(self, lease_id: int, epoch: int, ttl: float) -> Lease:
        """Move a live lease's deadline to now + ttl (same epoch); refused as `check` refuses."""
        _check_ttl(ttl)
        lease = replace(self.check(lease_id, epoch), deadline=self._clock.now() + ttl)
        self._live[lease_id] = lease
        heapq.heappush(self._deadlines, (lease.deadline, lease_id))
        return lease

    def release(self, lease_id: int, epoch: int) -> tuple[int, ...]:
        """End a live lease early and return its resources; refused as `check` refuses."""
        lease = self.check(lease_id, epoch)
        self._end(lease, expired=False)
        self.num_released_total += 1
        return lease.resource_ids

    def expire(self, now: float | None = None) -> list[Lease]:
        """End every lease whose deadline is <= now; the caller frees their resources."""
        now = self._clock.now() if now is None else now
        expired: list[Lease] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, lease_id = heapq.heappop(self._deadlines)
            lease = self._live.get(lease_id)
            if lease is None or lease.deadline != deadline:
                continue  # released, or renewed to a later deadline
            self._end(lease, expired=True)
            expired.append(lease)
        self.num_expired_total += len(expired)
        return expired

    def check(self, lease_id: int, epoch: int) -> Lease:
        """The live lease for (lease_id, epoch), or LeaseExpired / StaleLease / LeaseError."""
        lease = self._live.get(lease_id)
        if lease is not None:
            if epoch != lease.epoch:
                raise StaleLease(f"lease {lease_id}: epoch {epoch}, current {lease.epoch}")
            if self._clock.now() >= lease.deadline:
                raise LeaseExpired(f"lease {lease_id} ({lease.holder}): deadline passed")
            return lease
        ended = self._ended.get(lease_id)
        if ended is None:
            if 0 < lease_id < self._next_lease_id:
                raise LeaseExpired(f"lease {lease_id} ended long ago")
            raise LeaseError(f"lease {lease_id} was never granted by this table")
        old, expired = ended
        if epoch != old.epoch:
            raise StaleLease(f"lease {lease_id}: epoch {epoch}, granted as {old.epoch}")
        if not expired:
            raise StaleLease(f"lease {lease_id} ({old.holder}) was released")
        newer = max((self._epoch_of[rid] for rid in old.resource_ids), default=old.epoch)
        if newer > old.epoch:
            raise StaleLease(f"lease {lease_id} expired; its resources are under epoch {newer}")
        raise LeaseExpired(f"lease {lease_id} ({old.holder}) expired")

    # ---- queries -----------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """The earliest deadline among live leases (when to call `expire` next), or None."""
        while self._deadlines:
            deadline, lease_id = self._deadlines[0]
            lease = self._live.get(lease_id)
            if lease is not None and lease.deadline == deadline:
                return deadline
            heapq.heappop(self._deadlines)  # stale entry
        return None

    def lease_of(self, resource_id: int) -> Lease | None:
        """The live lease holding `resource_id`, if any."""
        lease_id = self._holder_of.get(resource_id)
        return None if lease_id is None else self._live[lease_id]

    @property
    def num_active(self) -> int:
        """Leases granted and not yet released or expired."""
        return len(self._live)

    @property
    def num_resources_held(self) -> int:
        """Resources under a live lease (pinned blocks, for the leak check)."""
        return len(self._holder_of)

    # ---- internals ---------------------------------------------------------------------------

    def _end(self, lease: Lease, *, expired: bool) -> None:
        del self._live[lease.lease_id]
        for rid in lease.resource_ids:
            del self._holder_of[rid]
        self._ended[lease.lease_id] = (lease, expired)
        while len(self._ended) > self._history:
            self._ended.popitem(last=False)


def _check_ttl(ttl: float) -> None:
    if not (math.isfinite(ttl) and ttl > 0):
        raise ValueError(f"lease ttl must be a finite number of seconds > 0, got {ttl}")
