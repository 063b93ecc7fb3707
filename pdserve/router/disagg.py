"""The disaggregated request path: reserve on decode, prefill elsewhere, stream, decode.

    ROUTED(P, D)   policy picks a decode worker D and a prefill worker P with D's digest
    RESERVED       POST D/reserve; refused → RETRYING → the next D; all refused → a bounded
                   wait for capacity (the queue), then 503 with Retry-After
    PREFILLING     POST P/prefill with the reservation (P pushes the KV to D afterwards)
    PREFILLED      the first token goes to the client at once
    TRANSFERRING   POST D/decode with first_token_id; D waits for verified KV
    COMMITTED, DECODING   D's first streamed line; tokens flow until D says finished
    FINISHED

Invariant 5 (reserve before prefill): `/prefill` is only ever called with a reservation this
flow obtained, so a refused reservation never wastes a prefill.

Recovery follows `RecoveryConfig.steps`, in order, each within its budget:
- **retry_transfer**: P resends the held snapshot itself (`transfer_attempts`, backoff + jitter
  inside the lease); the router only sees the end result.
- **reprefill**: P died or its transfer failed for good: a fresh reservation and a prefill on
  another prefill worker, under a worker-side id suffixed `.rN` so the old one cannot collide.
- **local_prefill**: no prefill worker could do it: a decode worker (D itself first) recomputes
  the prompt and the tokens already sent (`/generate` with `output_token_ids`): no transfer.
Every failed handoff is reported to `on_kv_outcome` (the circuit breaker), as is every commit.

Migration (invariant 4, exactly-once tokens): once the KV was committed, a failing decode side
is replaced by another decode worker that resumes after exactly the tokens the client has;
sampling is keyed by token index, so greedy and seeded text equal a run without the fault. At
most `max_migrations` workers are tried.

Whatever ends the stream early (an error, the client leaving, a stop string) the reservation
on D and any KV held on P are released before the generator finishes.

Placement (`AffinityPolicy`): D and P are ranked by cached prefix, session and load. A turn
whose D already holds all but a short suffix of the prompt skips P entirely: D runs it with
`/generate`, prefilling only the suffix (no reservation, no transfer; if D fails, the same
migration path takes over). A finished request tells the policy what D and P now cache.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass

from pdserve.errors import NoCapacity, RouterError, WorkerCallError, WorkerUnreachable
from pdserve.faults import FaultClosed, FaultInjector, FaultSite, perform
from pdserve.router.affinity import AffinityPolicy, RouteQuery
from pdserve.router.config import AffinityConfig, RecoveryConfig
from pdserve.router.flow import FlowRequest, TokenChunk
from pdserve.router.policy import WorkerView, pick_prefill, rank_decode
from pdserve.router.pool import WorkerPool
from pdserve.router.state import RequestState as S
from pdserve.router.worker_client import WorkerClient
from pdserve.worker.protocol import (
    DecodeRequest,
    ErrorBody,
    GenerateRequest,
    PrefillRequest,
    PrefillResult,
    RenewRequest,
    Reservation,
    ReserveRequest,
    TokenEvent,
)

# (ok, reason): one KV handoff succeeded (the decode side committed verified KV) or failed.
KVOutcome = Callable[[bool, str], None]
# Pause between rounds of reservations while a request waits in the queue for capacity.
_QUEUE_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class _Leg:
    """A reserved decode slot and the prefill worker chosen for it."""

    decode_url: str
    prefill_url: str
    worker_request_id: str
    reservation: Reservation


@dataclass(slots=True)
class _Placement:
    """Where a request ran, for the affinity policy once it finished."""

    query: RouteQuery
    decode_url: str | None = None
    prefill_url: str | None = None


class _PrefillSideFailed(Exception):
    """Every allowed prefill attempt failed on the prefill side (not for lack of decode)."""

    def __init__(self, cause: RouterError, tried: Collection[str]) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.tried = set(tried)


class _HandoffFailed(Exception):
    """The decode side failed before it committed verified KV (so before any decode token)."""

    def __init__(self, cause: RouterError) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _recoverable(exc: RouterError) -> bool:
    """Failures another worker may not share (dead, full, broken stream), as workers mark them."""
    return exc.retryable


class DisaggFlow:
    """Runs requests across a prefill and a decode worker."""

    def __init__(
        self,
        pool: WorkerPool,
        client: WorkerClient,
        eos_token_ids: Sequence[int],
        recovery: RecoveryConfig | None = None,
        lease_ttl_s: float = 30.0,
        on_kv_outcome: KVOutcome | None = None,
        faults: FaultInjector | None = None,
        affinity: AffinityPolicy | None = None,
    ) -> None:
        self._pool = pool
        self._client = client
        self._eos_token_ids = frozenset(eos_token_ids)
        self._recovery = recovery or RecoveryConfig()
        self._lease_ttl_s = lease_ttl_s
        # Told the outcome of every KV handoff (the circuit breaker listens here).
        self._on_kv_outcome = on_kv_outcome or (lambda ok, reason: None)
        self._num_queued = 0
        # Tests' fault injection at the router's sites; None: every site is a no-op.
        self._faults = faults
        # Placement; without one, plain least-load (what the flow did before affinity).
        self._affinity = affinity or AffinityPolicy(AffinityConfig(routing="load"))

    @property
    def num_queued(self) -> int:
        """Requests now waiting for a decode reservation."""
        return self._num_queued

    async def stream(self, request: FlowRequest) -> AsyncGenerator[TokenChunk, None]:
        """The request's tokens: the prefill's first token, then the decode worker's stream."""
        timeline = request.timeline
        steps = self._recovery.steps
        reprefills = self._recovery.max_reprefills if "reprefill" in steps else 0
        # Every token the client has been sent, in order: the resume point of any recovery.
        sent: list[int] = []
        leg: _Leg | None = None
        query = RouteQuery(
            request.prompt_token_ids,
            request.sampling.max_tokens,
            request.session_id,
            self._affinity.next_ticket(),
        )
        placed = _Placement(query)
        try:
            local = self._local_prefill_worker(query)
            if local is not None:
                label = f"affinity: {local} holds the prefix, local prefill of the suffix"
                async for chunk in self._resume(request, sent, local, label, placed):
                    yield chunk
                return
            try:
                leg, first, used = await self._prefill_with_retries(
                    request, placed, 1 + reprefills, ()
                )
            except _PrefillSideFailed as failed:
                if "local_prefill" not in steps:
                    raise failed.cause from None
                timeline.advance(S.RETRYING, f"local prefill: {failed.cause}")
                async for chunk in self._resume(request, sent, None, "local prefill", placed):
                    yield chunk
                return
            reprefills -= used - 1
            placed.decode_url, placed.prefill_url = leg.decode_url, leg.prefill_url
            timeline.advance(S.PREFILLED, f"first_token={first.first_token_id}")
            finish = self._first_token_finishes(request, first.first_token_id)
            if finish is not None:
                timeline.advance(S.FINISHED, f"first token: {finish}")
                yield TokenChunk([first.first_token_id], finish)
                return
            sent.append(first.first_token_id)
            yield TokenChunk([first.first_token_id])
            while True:
                current = leg
                try:
                    async for chunk in self._decode(request, current, sent[0]):
                        sent.extend(chunk.token_ids)
                        if chunk.finish_reason is not None:
                            # Before the yield: the consumer may close us right there.
                            leg = None  # finished: the worker freed everything itself
                        yield chunk
                        if leg is None:
                            return
                    raise WorkerUnreachable(current.decode_url, "decode stream ended early")
                except _HandoffFailed as failed:
                    self._on_kv_outcome(False, str(failed.cause))
                    leg = None
                    await self._forget_leg(current, failed.cause)
                    cause = failed.cause
                    if reprefills > 0:
                        reprefills -= 1
                        timeline.advance(S.RETRYING, f"handoff failed, re-prefill: {cause}")
                        try:
                            leg, _, _ = await self._prefill_with_retries(
                                request, placed, 1, (current.prefill_url,)
                            )
                            placed.decode_url = leg.decode_url
                            placed.prefill_url = leg.prefill_url
                            timeline.advance(S.PREFILLED, "re-prefilled")
                            continue
                        except _PrefillSideFailed as again:
                            cause = again.cause
                        except RouterError as again:
                            if not _recoverable(again):
                                raise
                            cause = again
                    if "local_prefill" not in steps:
                        raise cause from None
                    timeline.advance(S.RETRYING, f"local prefill: {cause}")
                    # The decode worker that had been chosen recomputes, if it is still up.
                    label, prefer = "local prefill", current.decode_url
                except RouterError as exc:
                    if not _recoverable(exc):
                        raise
                    leg = None
                    await self._forget_leg(current, exc)
                    timeline.advance(S.RETRYING, f"migrate after {len(sent)} tokens: {exc}")
                    label, prefer = "migration", None
                break
            async for chunk in self._resume(request, sent, prefer, label, placed):
                yield chunk
        except RouterError as exc:
            timeline.fail(str(exc))
            raise
        finally:
            if leg is not None:
                # Closed early or failed: D still holds the reservation (or the sequence), P
                # may hold KV awaiting transfer.
                await self._release(leg)
            if timeline.state is S.FINISHED and placed.decode_url is not None:
                self._affinity.record(
                    self._pool.snapshot(),
                    placed.decode_url,
                    placed.prefill_url,
                    request.prompt_token_ids,
                    sent,
                    request.session_id,
                )
            timeline.fail("closed before the worker finished")

    @contextlib.asynccontextmanager
    async def _renewing(self, leg: _Leg) -> AsyncIterator[None]:
        """Keep D's reservation alive while P prefills: a prefill queued past the lease TTL
        must not lose its slot. Only this router renews, so if it dies the lease still ends
        and frees the blocks (invariant 1)."""
        task = asyncio.create_task(self._renew_forever(leg), name=f"renew {leg.worker_request_id}")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _renew_forever(self, leg: _Leg) -> None:
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

    async def _fault(self, site: FaultSite, url: str) -> None:
        """A router fault site; an injected close reads as the connection to `url` failing."""
        if self._faults is None or (rule := self._faults.fire(site)) is None:
            return
        try:
            await perform(rule)
        except FaultClosed as exc:
            raise WorkerUnreachable(url, str(exc)) from exc

    def _local_prefill_worker(self, query: RouteQuery) -> str | None:
        """The best decode worker if it should prefill the uncached suffix itself."""
        views = self._pool.snapshot()
        for decode in self._affinity.rank_decode(views, query)[:1]:
            if self._affinity.local_prefill(decode, query):
                return decode.url
        return None

    async def _release(self, leg: _Leg) -> None:
        await self._client.release_quietly(leg.decode_url, leg.worker_request_id)
        await self._client.release_quietly(leg.prefill_url, leg.worker_request_id)

    async def _forget_leg(self, leg: _Leg, exc: RouterError) -> None:
        """Take a dead decode worker out of selection and release the leg's holds."""
        if isinstance(exc, WorkerUnreachable):
            self._pool.mark_failed(leg.decode_url, str(exc))
        await self._release(leg)

    async def _decode(
        self, request: FlowRequest, leg: _Leg, first_token_id: int
    ) -> AsyncGenerator[TokenChunk, None]:
        """D's stream after the first token; `_HandoffFailed` for a failure before commit."""
        timeline = request.timeline
        timeline.advance(S.TRANSFERRING, leg.decode_url)
        decode = DecodeRequest(
            request_id=leg.worker_request_id,
            first_token_id=first_token_id,
            # Past the reservation's lease the KV can no longer land anyway.
            kv_timeout_s=self._lease_ttl_s,
        )
        committed = False
        try:
            with self._pool.inflight(leg.decode_url):
                async with contextlib.aclosing(self._client.decode(leg.decode_url, decode)) as s:
                    async for event in s:
                        if event.error is not None or event.finish_reason == "error":
                            raise _stream_error(leg.decode_url, event)
                        if not committed:
                            committed = True
                            timeline.advance(S.COMMITTED)
                            self._on_kv_outcome(True, "")
                        if event.token_ids and timeline.state is S.COMMITTED:
                            timeline.advance(S.DECODING)
                        if event.finished:
                            timeline.advance(S.FINISHED, event.finish_reason or "")
                            yield TokenChunk(
                                event.token_ids, event.finish_reason or "stop", event.step
                            )
                            return
                        yield TokenChunk(event.token_ids, step=event.step)
        except RouterError as exc:
            # Before the commit any failure (D dead, KV never verified, reservation gone) is
            # the handoff's; after it, the decode's.
            if committed or (isinstance(exc, WorkerCallError) and exc.status == 400):
                raise
            raise _HandoffFailed(exc) from exc

    async def _resume(
        self,
        request: FlowRequest,
        sent: list[int],
        prefer: str | None,
        label: str,
        placed: _Placement,
    ) -> AsyncGenerator[TokenChunk, None]:
        """Run the request on a decode worker from after `sent`, prompt recomputed there."""
        timeline = request.timeline
        failed: set[str] = set()
        budget = max(1, self._recovery.max_migrations)
        for n in range(1, budget + 1):
            candidates = [v.url for v in rank_decode(self._pool.snapshot(), exclude=failed)]
            if prefer in candidates:
                candidates.remove(prefer)
                candidates.insert(0, prefer)
            if not candidates:
                raise NoCapacity(
                    f"{label} of {request.request_id}: no decode worker left"
                    f" (failed {sorted(failed)})"
                )
            url = candidates[0]
            placed.decode_url = url
            rid = f"{request.request_id}.m{n}"
            timeline.advance(S.ROUTED, f"{label} to {url} after {len(sent)} tokens")
            body = GenerateRequest(
                request_id=rid,
                prompt_token_ids=request.prompt_token_ids,
                sampling=request.sampling,
                output_token_ids=list(sent),
            )
            finished = False
            try:
                with self._pool.inflight(url):
                    async with contextlib.aclosing(self._client.generate(url, body)) as s:
                        async for event in s:
                            if event.error is not None or event.finish_reason == "error":
                                raise _stream_error(url, event)
                            if timeline.state is S.ROUTED:
                                timeline.advance(S.DECODING, url)
                            sent.extend(event.token_ids)
                            if event.finished:
                                finished = True
                                timeline.advance(S.FINISHED, event.finish_reason or "")
                                yield TokenChunk(
                                    event.token_ids, event.finish_reason or "stop", event.step
                                )
                                return
                            yield TokenChunk(event.token_ids, step=event.step)
                raise WorkerUnreachable(url, "stream ended before finished")
            except RouterError as exc:
                if isinstance(exc, WorkerUnreachable):
                    self._pool.mark_failed(url, str(exc))
                if n == budget or not _recoverable(exc):
                    raise
                failed.add(url)
                timeline.advance(S.RETRYING, f"{label} {n} failed: {exc}")
            finally:
                if not finished:
                    await self._client.release_quietly(url, rid)
        raise AssertionError("unreachable: the last attempt re-raises")

    def _first_token_finishes(self, request: FlowRequest, token_id: int) -> str | None:
        sampling = request.sampling
        if token_id in sampling.stop_token_ids or (
            not sampling.ignore_eos and token_id in self._eos_token_ids
        ):
            return "stop"
        return "length" if sampling.max_tokens <= 1 else None

    async def _prefill_with_retries(
        self, request: FlowRequest, placed: _Placement, attempts: int, skip: Collection[str]
    ) -> tuple[_Leg, PrefillResult, int]:
        """Reserve and prefill, moving to another prefill worker on failure.

        Returns the leg, the result and the attempts used. Raises `_PrefillSideFailed` when
        every attempt failed on the prefill side; reservation failures (no decode capacity)
        propagate as they are, since a local prefill would not find room either.
        """
        timeline = request.timeline
        skip_prefill = set(skip)
        for attempt in range(attempts):
            n = sum(1 for t in timeline.history if t.state is S.PREFILLING)
            rid = request.request_id if n == 0 else f"{request.request_id}.r{n}"
            try:
                leg = await self._route_and_reserve(request, placed.query, rid, skip_prefill)
            except NoCapacity as exc:
                if _only_prefill_missing(self._pool.snapshot(), skip_prefill):
                    raise _PrefillSideFailed(exc, skip_prefill) from exc
                raise
            try:
                timeline.advance(S.PREFILLING, leg.prefill_url)
                prefill = PrefillRequest(
                    request_id=rid,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling=request.sampling,
                    reservation=leg.reservation,
                    lease_ttl_s=self._lease_ttl_s,
                    transfer_attempts=self._recovery.send_attempts,
                    decode_url=leg.decode_url,
                )
                with self._pool.inflight(leg.prefill_url):
                    async with self._renewing(leg):
                        result = await self._client.prefill(leg.prefill_url, prefill)
                await self._fault(FaultSite.ROUTER_AFTER_PREFILL, leg.prefill_url)
                return leg, result, attempt + 1
            except BaseException as exc:
                await self._release(leg)
                if not isinstance(exc, RouterError) or not _recoverable(exc):
                    raise
                if isinstance(exc, WorkerUnreachable):
                    self._pool.mark_failed(leg.prefill_url, str(exc))
                skip_prefill.add(leg.prefill_url)
                if attempt + 1 == attempts:
                    raise _PrefillSideFailed(exc, skip_prefill) from exc
                timeline.advance(S.RETRYING, f"prefill failed: {exc}")
        raise AssertionError("unreachable: the last attempt raises")

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

    async def _route_and_reserve(
        self, request: FlowRequest, query: RouteQuery, rid: str, skip_prefill: Collection[str]
    ) -> _Leg:
        """Reserve on the best decode worker that has a prefill partner; next one on refusal.

        When every decode worker refused for capacity, the request waits (at most
        `queue_timeout_s`, with at most `max_queued` waiting) and tries again; never prefills
        first.
        """
        timeline = request.timeline
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        try:
            while True:
                tried: set[str] = set()
                refused_for_capacity = False
                while (pair := self._pick_pair(query, tried, skip_prefill)) is not None:
                    decode, prefill = pair
                    timeline.advance(S.ROUTED, f"decode={decode.url} prefill={prefill.url}")
                    try:
                        await self._fault(FaultSite.ROUTER_BEFORE_RESERVE, decode.url)
                        # Counted on both workers from now: a burst arriving together sees
                        # each other's choices, not the same last poll.
                        with self._pool.inflight(decode.url), self._pool.inflight(prefill.url):
                            reservation = await self._client.reserve(
                                decode.url,
                                ReserveRequest(
                                    request_id=rid,
                                    prompt_token_ids=request.prompt_token_ids,
                                    sampling=request.sampling,
                                    lease_ttl_s=self._lease_ttl_s,
                                ),
                            )
                    except RouterError as exc:
                        if not _recoverable(exc):
                            raise
                        if isinstance(exc, WorkerUnreachable):
                            self._pool.mark_failed(decode.url, str(exc))
                        else:
                            refused_for_capacity = True
                        tried.add(decode.url)
                        timeline.advance(S.RETRYING, str(exc))
                        continue
                    timeline.advance(S.RESERVED, reservation.transfer_id)
                    return _Leg(decode.url, prefill.url, rid, reservation)
                detail = (
                    f"no decode worker with a compatible prefill worker accepted {rid}"
                    f" (tried {sorted(tried)})"
                )
                if deadline is None:
                    can_wait = (
                        refused_for_capacity
                        and self._recovery.queue_timeout_s > 0
                        and self._num_queued < self._recovery.max_queued
                    )
                    if not can_wait:
                        raise NoCapacity(detail)
                    deadline = loop.time() + self._recovery.queue_timeout_s
                    self._num_queued += 1
                elif loop.time() >= deadline:
                    raise NoCapacity(f"{detail}; waited {self._recovery.queue_timeout_s} s")
                await asyncio.sleep(_QUEUE_POLL_S)
        finally:
            if deadline is not None:
                self._num_queued -= 1


def _only_prefill_missing(views: Sequence[WorkerView], skip_prefill: Collection[str]) -> bool:
    """True if decode workers are up but none has a usable prefill partner (dead or skipped)."""
    decodes = rank_decode(views)
    return bool(decodes) and all(pick_prefill(views, d, skip_prefill) is None for d in decodes)


def _stream_error(url: str, event: TokenEvent) -> WorkerCallError:
    detail = event.error or "stream failed"
    return WorkerCallError(url, 500, ErrorBody(error=detail, type="StreamError", retryable=True))
