"""Decode reservations for the disaggregated flow: choosing the pair, reserving, waiting for
room, and keeping a reservation alive while its prefill runs.

    pick a pair   the best decode worker (not yet tried) that has a compatible prefill worker
    reserve       POST D/reserve; refused → RETRYING(reserve_refused) → the next pair
    all refused   or none up: the capacity queue (FIFO, woken when room may be back or a
                  worker answers again), then another round; the queue's time is up:
                  NoCapacity (503 + Retry-After)
    renew         POST D/renew every TTL/3 while P prefills; once the KV flows, its bytes renew

Invariant 5 (reserve before prefill): this module only reserves; a refused reservation never
reaches a prefill worker. Only this router renews, so if it dies the lease still lapses and
frees the blocks (invariant 1).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass

from pdserve.errors import NoCapacity, RouterError, WorkerUnreachable
from pdserve.faults import FaultClosed, FaultInjector, FaultSite, perform
from pdserve.protocol.request_state import Reason
from pdserve.protocol.worker_api import RenewRequest, Reservation, ReserveRequest
from pdserve.router.flows import progress
from pdserve.router.flows.capacity_queue import CapacityQueue
from pdserve.router.flows.flow import FlowRequest
from pdserve.router.placement.affinity import AffinityPolicy, RouteQuery
from pdserve.router.placement.policy import WorkerView
from pdserve.router.workers.client import WorkerClient
from pdserve.router.workers.pool import WorkerPool
from pdserve.tasks import cancel_and_wait


@dataclass(frozen=True, slots=True)
class Leg:
    """A reserved decode slot and the prefill worker chosen for it."""

    decode_url: str
    prefill_url: str
    worker_request_id: str
    reservation: Reservation


async def router_fault(faults: FaultInjector | None, site: FaultSite, url: str) -> None:
    """A router fault site; an injected close reads as the connection to `url` failing."""
    if faults is None or (rule := faults.fire(site)) is None:
        return
    try:
        await perform(rule)
    except FaultClosed as exc:
        raise WorkerUnreachable(url, str(exc)) from exc


class Reserver:
    """Reserves decode slots for one router."""

    def __init__(
        self,
        pool: WorkerPool,
        client: WorkerClient,
        affinity: AffinityPolicy,
        queue: CapacityQueue,
        *,
        lease_ttl_s: float,
        queue_timeout_s: float,
        faults: FaultInjector | None = None,
    ) -> None:
        self._pool = pool
        self._client = client
        self._affinity = affinity
        self.queue = queue
        self._lease_ttl_s = lease_ttl_s
        self._queue_timeout_s = queue_timeout_s
        self._faults = faults

    async def reserve(
        self, request: FlowRequest, query: RouteQuery, rid: str, skip_prefill: Collection[str]
    ) -> Leg:
        """Reserve on the best decode worker that has a prefill partner; the next on refusal;
        the capacity queue when every one refused for room. NoCapacity when none will do."""
        leg, _, tried = await self._round(request, query, rid, skip_prefill)
        if leg is not None:
            return leg
        detail = f"no decode worker with a compatible prefill worker accepted {rid}"
        if self._queue_timeout_s <= 0 or self._only_skipped_prefill_left(query, skip_prefill):
            raise NoCapacity(detail, tried=tried)
        # Wait in line, whether the workers refused for room or none is up or reachable (a
        # partition, a restart): room that frees and a worker that answers again both wake
        # the queue, so the request is served as soon as either happens, within its time.
        loop = asyncio.get_running_loop()
        deadline = min(loop.time() + self._queue_timeout_s, request.deadline)
        async with self.queue.join(detail) as waiter:
            while True:
                try:
                    await waiter.next_chance(deadline)
                except TimeoutError:
                    raise NoCapacity(
                        f"{detail}; waited {self._queue_timeout_s} s in the queue", tried=tried
                    ) from None
                try:
                    leg, _, tried = await self._round(request, query, rid, skip_prefill)
                except BaseException:
                    # Cut short while using its chance (a cancel, a fault): the chance goes on
                    # with it, to the next in line, instead of waiting for another wake-up.
                    waiter.pass_on()
                    raise
                if leg is not None:
                    break
                if self._only_skipped_prefill_left(query, skip_prefill):
                    # Workers are back, but its only prefill partners are those it failed on:
                    # waiting cannot help it, and at the head it would hold up every request
                    # behind it. The chance goes on; the flow recovers without a prefill worker.
                    waiter.pass_on()
                    raise NoCapacity(f"{detail}; only prefill workers it failed on are up")
        self.queue.notify()  # there was room: the next in line may find some too
        return leg

    def _only_skipped_prefill_left(self, query: RouteQuery, skip_prefill: Collection[str]) -> bool:
        """Whether a decode worker is up with a prefill partner, but every such partner is one
        this request skips (it failed there): no wait in the queue will give it a pair."""
        return bool(skip_prefill) and (
            self._pick_pair(query, (), ()) is not None
            and self._pick_pair(query, (), skip_prefill) is None
        )

    def _pick_pair(
        self, query: RouteQuery, tried: Collection[str], skip_prefill: Collection[str]
    ) -> tuple[WorkerView, WorkerView] | None:
        """The best decode worker (not yet tried) that has a prefill partner, and that one."""
        views = self._pool.snapshot()
        for decode in self._affinity.rank_decode(views, query, exclude=tried):
            prefill = self._affinity.pick_prefill(views, decode, query, exclude=skip_prefill)
            if prefill is not None:
                return decode, prefill
        return None

    async def _round(
        self, request: FlowRequest, query: RouteQuery, rid: str, skip_prefill: Collection[str]
    ) -> tuple[Leg | None, bool, set[str]]:
        """Try every decode worker once: (the leg, or None; whether any refused for room;
        the workers tried)."""
        timeline = request.timeline
        tried: set[str] = set()
        refused_for_capacity = False
        while (pair := self._pick_pair(query, tried, skip_prefill)) is not None:
            decode, prefill = pair
            progress.routed(timeline, f"decode={decode.url} prefill={prefill.url}")
            try:
                await router_fault(self._faults, FaultSite.ROUTER_BEFORE_RESERVE, decode.url)
                # Counted on both workers from now: a burst arriving together sees each
                # other's choices, not the same last poll.
                with self._pool.inflight(decode.url), self._pool.inflight(prefill.url):
                    reservation = await self._client.reserve(
                        decode.url,
                        ReserveRequest(
                            request_id=rid,
                            prompt_token_ids=request.prompt_token_ids,
                            sampling=request.sampling,
                            lease_ttl_s=self._lease_ttl_s,
                        ),
                        request.remaining_s(),
                    )
            except RouterError as exc:
                if not exc.retryable:
                    raise
                if isinstance(exc, WorkerUnreachable):
                    self._pool.mark_failed(decode.url, str(exc))
                else:
                    refused_for_capacity = True
                tried.add(decode.url)
                progress.retrying(timeline, Reason.RESERVE_REFUSED, str(exc))
                continue
            progress.reserved(timeline, reservation.transfer_id)
            return Leg(decode.url, prefill.url, rid, reservation), refused_for_capacity, tried
        return None, refused_for_capacity, tried

    @contextlib.asynccontextmanager
    async def renewing(self, leg: Leg) -> AsyncIterator[None]:
        """Keep D's reservation alive while P prefills: a prefill queued past the lease TTL
        must not lose its slot."""
        task = asyncio.create_task(self._renew_forever(leg), name=f"renew {leg.worker_request_id}")
        try:
            yield
        finally:
            await cancel_and_wait(task)

    async def _renew_forever(self, leg: Leg) -> None:
        # A third of the TTL: two renewals may be lost before the lease lapses.
        while True:
            await asyncio.sleep(self._lease_ttl_s / 3)
            try:
                await self._client.renew(
                    leg.decode_url, RenewRequest(request_id=leg.worker_request_id)
                )
            except RouterError:
                # Gone or unreachable: /decode reports it with the reason; nothing to renew.
                return

    async def release(self, leg: Leg) -> None:
        """Free whatever both workers hold for the leg (both at once, quietly, even when
        cancelled)."""
        await self._client.release_quietly(leg.decode_url, leg.worker_request_id, leg.prefill_url)
