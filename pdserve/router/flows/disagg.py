"""The disaggregated request path: reserve on decode, prefill elsewhere, stream, decode.

    ROUTED(P, D)   policy picks a decode worker D and a prefill worker P with D's digest
    RESERVED       POST D/reserve; refused → RETRYING(reserve_refused) → the next D; all
                   refused for room → the capacity queue (FIFO, woken by releases), then 503
                   (all of this is `reservations.py`)
    PREFILLING     POST P/prefill with the reservation signed by this router (P sends KV only
                   to a reservation it can verify); D's lease is renewed while P works
    PREFILLED      the first token goes to the client at once
    TRANSFERRING   POST D/decode; D waits for verified KV, checks it by value (the canary)
    COMMITTED, DECODING   D's first line (how the KV came), then tokens until D says finished
    FINISHED

Invariant 5 (reserve before prefill): `/prefill` is only ever called with a reservation this
flow obtained, so a refused reservation never wastes a prefill.

Recovery is the table in `recovery.py`: each failure names the steps that may follow, in
order, within the request's budget (re-prefills, migrations) and `--recovery`. The flow only
executes steps: the normal handoff (also a re-prefill on another prefill worker, under a
worker-side id suffixed `.rN`), a local prefill on a decode worker (`/generate` with the tokens
already sent), a migration (the same, on another decode worker). Every failed handoff, and
every handoff D reports slow, is reported to `on_kv_outcome` (the circuit breaker), as is
every commit.

Exactly-once tokens (invariant 4): `sent` holds every token the client has; any resumption
starts after them, and sampling is keyed by token index, so greedy and seeded text equal a
run without the fault.

Deadlines (invariant 9): every worker call is bounded by the request's deadline and tells the
worker how long it still has, so a frozen router or worker cannot hold a request past it.

Whatever ends the stream early (an error, the client leaving, a stop string) the reservation
on D and any KV held on P are released before the generator finishes, and the capacity queue
is told that room may be back.

Placement (`AffinityPolicy`): D and P are ranked by cached prefix, session and load. A turn
whose D already holds all but a short suffix of the prompt skips P entirely: D runs it with
`/generate`, prefilling only the suffix (no reservation, no transfer; if D fails, the same
migration path takes over). A finished request tells the policy what D and P now cache.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Collection, Sequence
from dataclasses import dataclass, field, replace

from pdserve.errors import NoCapacity, RouterError, WorkerUnreachable
from pdserve.faults import FaultInjector, FaultSite
from pdserve.protocol.request_state import RequestState as S
from pdserve.protocol.reservation_signing import sign_reservation
from pdserve.protocol.worker_api import (
    DecodeRequest,
    GenerateRequest,
    PrefillRequest,
    PrefillResult,
)
from pdserve.router.config import AffinityConfig, RecoveryConfig
from pdserve.router.flows import checkpoint_plan, handoff_outcome, progress
from pdserve.router.flows.capacity_queue import CapacityQueue
from pdserve.router.flows.flow import FlowRequest, TokenChunk
from pdserve.router.flows.handoff_outcome import Handoff, KVOutcome
from pdserve.router.flows.recovery import (
    STEP_REASON,
    Budget,
    Cause,
    Phase,
    Step,
    StepFailed,
    cause_of,
    classify,
    fail_step,
    next_step,
)
from pdserve.router.flows.reservations import Leg, Reserver, router_fault
from pdserve.router.flows.worker_stream import until_finished
from pdserve.router.placement.affinity import AffinityPolicy, RouteQuery
from pdserve.router.placement.policy import WorkerView, pick_prefill, rank_decode
from pdserve.router.workers.client import WorkerClient
from pdserve.router.workers.pool import WorkerPool


@dataclass(slots=True)
class _Run:
    """One request's progress through its steps (owned by its `stream` call)."""

    request: FlowRequest
    query: RouteQuery
    budget: Budget
    # Every token the client has been sent, in order: the resume point of any recovery.
    sent: list[int] = field(default_factory=list)
    # The leg whose holds must be released if the request ends now.
    leg: Leg | None = None
    # Where it ran, for the affinity policy once it finished.
    decode_url: str | None = None
    prefill_url: str | None = None
    # Workers a later step must not use again for this request.
    failed_prefill: set[str] = field(default_factory=set)
    failed_decode: set[str] = field(default_factory=set)
    # Resumptions started (their worker-side ids are suffixed `.mN`).
    num_resumes: int = 0
    # The worker holding the current leg's decode checkpoints (None: none).
    holder: str | None = None
    # The worker that computed the prompt's KV (its prefix cache may still hold it).
    first_prefill_url: str | None = None


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
        *,
        reservation_key: bytes | None = None,
        queue: CapacityQueue | None = None,
    ) -> None:
        self._pool = pool
        self._client = client
        self._eos_token_ids = frozenset(eos_token_ids)
        self._recovery = recovery or RecoveryConfig()
        self._lease_ttl_s = lease_ttl_s
        # Told the outcome of every KV handoff (the circuit breaker listens here).
        self._on_kv_outcome = on_kv_outcome or (lambda outcome, reason: None)
        # Tests' fault injection at the router's sites; None: every site is a no-op.
        self._faults = faults
        # Placement; without one, plain least-load (what the flow did before affinity).
        self._affinity = affinity or AffinityPolicy(AffinityConfig(routing="load"))
        # Signs the reservations handed to prefill workers (None: an insecure cluster).
        self._reservation_key = reservation_key
        self.queue = queue or CapacityQueue(self._recovery.max_queued)
        self._reserver = Reserver(
            pool,
            client,
            self._affinity,
            self.queue,
            lease_ttl_s=lease_ttl_s,
            queue_timeout_s=self._recovery.queue_timeout_s,
            faults=faults,
        )

    @property
    def num_queued(self) -> int:
        """Requests now waiting for a decode reservation."""
        return self.queue.num_waiting

    async def stream(self, request: FlowRequest) -> AsyncGenerator[TokenChunk, None]:
        """The request's tokens: the prefill's first token, then the decode worker's stream."""
        timeline = request.timeline
        recovery = self._recovery
        query = RouteQuery(
            request.prompt_token_ids,
            request.sampling.max_tokens,
            request.session_id,
            self._affinity.next_ticket(),
        )
        budget = Budget(
            recovery.max_reprefills if "reprefill" in recovery.steps else 0,
            recovery.max_migrations,
        )
        run = _Run(request, query, budget)
        try:
            step: Step | None = None  # None: the first handoff
            prefer: str | None = None
            local = self._local_prefill_worker(query)
            label = "local prefill"
            if local is not None:
                step, prefer = Step.LOCAL_PREFILL, local
                label = f"affinity: {local} holds the prefix, local prefill of the suffix"
            while True:
                try:
                    if step is None or step is Step.REPREFILL:
                        steps = self._handoff(run)
                    else:
                        steps = self._resume(run, prefer, label)
                    async with contextlib.aclosing(steps) as chunks:
                        async for chunk in chunks:
                            yield chunk
                    return
                except StepFailed as failed:
                    step = next_step(failed.failure, recovery.steps, run.budget)
                    if step is None:
                        raise failed.cause from None
                    run.budget.spend(step)
                    prefer = failed.decode_url if step is Step.LOCAL_PREFILL else None
                    label = "local prefill" if step is Step.LOCAL_PREFILL else "migration"
                    progress.retrying(
                        timeline,
                        STEP_REASON[(failed.failure, step)],
                        f"{step.value} after {len(run.sent)} tokens"
                        f" ({failed.failure.value}): {failed.cause}",
                    )
        except RouterError as exc:
            progress.failed(timeline, str(exc))
            raise
        finally:
            try:
                if run.leg is not None:
                    # Closed early or failed: D still holds the reservation (or the sequence),
                    # P may hold KV awaiting transfer. The release itself is shielded.
                    await self._reserver.release(run.leg)
            finally:
                # Even when a cancel lands in the release (the client hung up twice).
                self._settle(run)

    def _settle(self, run: _Run) -> None:
        """What ends every request: its affinity recorded if it finished, its timeline ended,
        the queue told its decode blocks are free again."""
        request, timeline = run.request, run.request.timeline
        if timeline.state is S.FINISHED and run.decode_url is not None:
            self._affinity.record(
                self._pool.snapshot(),
                run.decode_url,
                run.prefill_url,
                request.prompt_token_ids,
                run.sent,
                request.session_id,
            )
        progress.failed(timeline, "closed before the worker finished")
        self.queue.notify()

    # ---- the handoff: reserve, prefill, transfer, decode ----------------------------------

    async def _handoff(self, run: _Run) -> AsyncGenerator[TokenChunk, None]:
        """One handoff on the best decode/prefill pair not yet failed; `StepFailed` when it
        fails in a way the recovery table can answer."""
        request = run.request
        timeline = request.timeline
        n = sum(1 for t in timeline.history if t.state is S.PREFILLING)
        rid = request.request_id if n == 0 else f"{request.request_id}.r{n}"
        try:
            leg = await self._reserver.reserve(request, run.query, rid, run.failed_prefill)
        except NoCapacity as exc:
            views = self._affinity.revision_views(self._pool.snapshot(), run.query)
            if _only_prefill_missing(views, run.failed_prefill):
                fail_step(Phase.RESERVE, exc, Cause.NO_PREFILL)
            raise
        run.leg = leg
        result = await self._prefill(run, leg)
        run.decode_url, run.prefill_url = leg.decode_url, leg.prefill_url
        run.first_prefill_url = run.first_prefill_url or leg.prefill_url
        progress.prefilled(timeline, result.first_token_id)
        if not run.sent:
            finish = self._first_token_finishes(request, result.first_token_id)
            if finish is not None:
                progress.finished(timeline, f"first token: {finish}")
                yield TokenChunk.of_prefill(result, finish)
                return
            run.sent.append(result.first_token_id)
            self._pin(run, leg.decode_url)
            yield TokenChunk.of_prefill(result)
        # A re-prefill after the first token was sent draws that same token (same seed and
        # index): decoding continues after the token the client has.
        async with contextlib.aclosing(self._decode(run, leg)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _prefill(self, run: _Run, leg: Leg) -> PrefillResult:
        request = run.request
        timeline = request.timeline
        try:
            progress.prefilling(timeline, leg.prefill_url)
            remaining = request.remaining_s()
            signed = sign_reservation(
                self._reservation_key,
                leg.reservation,
                leg.decode_url,
                time.time() + (remaining if remaining is not None else self._lease_ttl_s * 10),
            )
            prefill = PrefillRequest(
                request_id=leg.worker_request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling=request.sampling,
                reservation=signed,
                lease_ttl_s=self._lease_ttl_s,
                transfer_attempts=self._recovery.send_attempts,
                deadline_s=remaining,
            )
            with self._pool.inflight(leg.prefill_url):
                async with self._reserver.renewing(leg):
                    result = await self._client.prefill(leg.prefill_url, prefill, remaining)
            await router_fault(self._faults, FaultSite.ROUTER_AFTER_PREFILL, leg.prefill_url)
            return result
        except RouterError as exc:
            run.leg = None
            await self._reserver.release(leg)
            if isinstance(exc, WorkerUnreachable):
                self._pool.mark_failed(leg.prefill_url, str(exc))
            if classify(Phase.PREFILL, cause_of(exc)) is not None:
                run.failed_prefill.add(leg.prefill_url)
            fail_step(Phase.PREFILL, exc, decode_url=leg.decode_url)
            raise

    async def _decode(self, run: _Run, leg: Leg) -> AsyncGenerator[TokenChunk, None]:
        """D's stream after the first token; `StepFailed` (handoff_failed before the commit,
        decode_died after it) when D fails."""
        request = run.request
        timeline = request.timeline
        progress.transferring(timeline, leg.decode_url)
        remaining = request.remaining_s()
        run.holder = checkpoint_plan.choose_holder(self._pool.snapshot(), leg.decode_url)
        decode = DecodeRequest(
            request_id=leg.worker_request_id,
            first_token_id=run.sent[0],
            # The reservation's lease ends a silent transfer sooner; this bounds a slow one.
            kv_timeout_s=remaining or self._lease_ttl_s * 10,
            deadline_s=remaining,
            checkpoint=checkpoint_plan.plan(self._recovery, run.holder),
        )
        committed = False
        try:
            with self._pool.inflight(leg.decode_url):
                async with (
                    contextlib.aclosing(self._client.decode(leg.decode_url, decode)) as s,
                    contextlib.aclosing(until_finished(leg.decode_url, s, "decode")) as events,
                ):
                    async for event in events:
                        if not committed:
                            committed = True
                            progress.committed(timeline, handoff_outcome.detail(event))
                            self._on_kv_outcome(*handoff_outcome.of_commit(event))
                        if event.token_ids and timeline.state is S.COMMITTED:
                            progress.decoding(timeline)
                        run.sent.extend(event.token_ids)
                        if event.finished:
                            run.leg = None  # finished: the worker freed everything itself
                            yield progress.finished_by_worker(timeline, event)
                            return
                        if event.token_ids:
                            yield TokenChunk.of_event(event)
        except RouterError as exc:
            run.leg = None
            if isinstance(exc, WorkerUnreachable):
                self._pool.mark_failed(leg.decode_url, str(exc))
            if committed:  # D died mid-decode: the migration does not wait on it
                self._client.release_in_background(leg.decode_url, leg.worker_request_id)
                await self._client.release_quietly(leg.prefill_url, leg.worker_request_id)
            else:
                await self._reserver.release(leg)
                # Any failure before the commit (D dead, KV never verified or failed its value
                # check, reservation gone) is the handoff's.
                self._on_kv_outcome(Handoff.FAILED, str(exc))
            phase = Phase.DECODE if committed else Phase.HANDOFF
            if classify(phase, cause_of(exc)) is not None:
                (run.failed_decode if committed else run.failed_prefill).add(
                    leg.decode_url if committed else leg.prefill_url
                )
            fail_step(phase, exc, decode_url=None if committed else leg.decode_url)
            raise

    # ---- resumption: local prefill and migration -----------------------------------------

    async def _resume(
        self, run: _Run, prefer: str | None, label: str
    ) -> AsyncGenerator[TokenChunk, None]:
        """Run the request on one decode worker from after `sent`, prompt recomputed there;
        `StepFailed(resume_failed)` if that worker fails."""
        request = run.request
        timeline = request.timeline
        views = self._affinity.revision_views(self._pool.snapshot(), run.query)
        candidates = [v.url for v in rank_decode(views, exclude=run.failed_decode)]
        if prefer is None and run.sent:
            prefer = checkpoint_plan.resume_on(self._recovery, run.holder)
        if prefer in candidates:
            candidates.remove(prefer)
            candidates.insert(0, prefer)
        if not candidates:
            raise NoCapacity(
                f"{label} of {request.request_id}: no decode worker left",
                tried=run.failed_decode,
            )
        url = candidates[0]
        run.decode_url, run.prefill_url = url, None
        run.num_resumes += 1
        rid = f"{request.request_id}.m{run.num_resumes}"
        progress.routed(timeline, f"{label} to {url} after {len(run.sent)} tokens")
        recovery = self._recovery
        source = None
        if run.sent:
            tokens = [*request.prompt_token_ids, *run.sent]
            views = self._pool.snapshot()
            # The resuming worker counts its own cache itself; dead ones are never asked.
            skip = {url, *run.failed_decode, *run.failed_prefill}
            caches = checkpoint_plan.cache_sources(
                self._affinity.cache_holders(views, tokens, skip), run.first_prefill_url, skip
            )
            source = checkpoint_plan.source(recovery, run.holder, caches)
        run.holder = checkpoint_plan.choose_holder(
            self._affinity.revision_views(self._pool.snapshot(), run.query),
            url,
            keep=run.holder,
            exclude=run.failed_decode,
        )
        body = GenerateRequest(
            request_id=rid,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            output_token_ids=list(run.sent),
            deadline_s=request.remaining_s(),
            checkpoint=checkpoint_plan.plan(recovery, run.holder),
            checkpoint_from=source,
        )
        finished = False
        try:
            with self._pool.inflight(url):
                async with (
                    contextlib.aclosing(self._client.generate(url, body)) as s,
                    contextlib.aclosing(until_finished(url, s, "generate")) as events,
                ):
                    async for event in events:
                        if timeline.state is S.ROUTED:
                            progress.decoding(timeline, url)
                        run.sent.extend(event.token_ids)
                        self._pin(run, url)
                        if event.finished:
                            finished = True
                            yield progress.finished_by_worker(timeline, event)
                            return
                        yield TokenChunk.of_event(event)
        except RouterError as exc:
            if isinstance(exc, WorkerUnreachable):
                self._pool.mark_failed(url, str(exc))
            if classify(Phase.RESUME, cause_of(exc)) is not None:
                run.failed_decode.add(url)
            fail_step(Phase.RESUME, exc)
            raise
        finally:
            if not finished and url in run.failed_decode:
                self._client.release_in_background(url, rid)  # the next worker goes on now
            elif not finished:
                await self._client.release_quietly(url, rid)

    # ---- reservations ----------------------------------------------------------------------

    def _local_prefill_worker(self, query: RouteQuery) -> str | None:
        """The best decode worker if it should prefill the uncached suffix itself."""
        views = self._pool.snapshot()
        for decode in self._affinity.rank_decode(views, query)[:1]:
            if self._affinity.local_prefill(decode, query):
                return decode.url
        return None

    def _pin(self, run: _Run, url: str) -> None:
        """Keep the request on the revision that computed what the client has now."""
        if run.query.revision is None and run.sent:
            run.query = replace(run.query, revision=self._pool.digest_of(url))

    def _first_token_finishes(self, request: FlowRequest, token_id: int) -> str | None:
        sampling = request.sampling
        if token_id in sampling.stop_token_ids or (
            not sampling.ignore_eos and token_id in self._eos_token_ids
        ):
            return "stop"
        return "length" if sampling.max_tokens <= 1 else None


def _only_prefill_missing(views: Sequence[WorkerView], skip_prefill: Collection[str]) -> bool:
    """True if decode workers are up but none has a usable prefill partner (dead or skipped)."""
    decodes = rank_decode(views)
    return bool(decodes) and all(pick_prefill(views, d, skip_prefill) is None for d in decodes)
