"""The worker's HTTP control API (aiohttp), exactly as `protocol.py` defines it.

Handlers parse a body into its protocol model, check the worker's role, and drive the parts:
the engine loop (every engine call), the inbox (decode-side reservations), the outbox
(prefill-side sends) and the lease keeper. Errors are raised, never rendered here: the
middleware in `http_errors` turns them into `ErrorBody` responses.

Invariants:
- Reserve before release: /prefill parses and checks its reservation before any prefill runs.
- No leak: a handler that leaves early (error, client gone: aiohttp cancels the handler) aborts
  whatever it had put in the engine; a finished prefill's held KV is either handed to the
  outbox (which always releases it) or released at once.
- Streams (NDJSON, one `TokenEvent` per line) end with exactly one `finished` event unless the
  client went away.

It knows HTTP, the protocol models and the worker's parts; not sockets of the KV data plane.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel

from pdserve.engine.engine import Engine
from pdserve.errors import EngineError, PdserveError, RequestNotFound, WrongRole
from pdserve.faults import FaultClosed, FaultInjector, FaultSite, parse_rules, perform
from pdserve.observability.timeline_log import EventRing
from pdserve.worker.config import WorkerConfig
from pdserve.worker.engine_loop import DeltaQueue, EngineInfo, EngineLoop
from pdserve.worker.http_errors import Handler, error_middleware
from pdserve.worker.kv_events import KVEventStreams
from pdserve.worker.kv_inbox import KVInbox
from pdserve.worker.kv_outbox import Destination, KVOutbox
from pdserve.worker.lease_keeper import LeaseKeeper
from pdserve.worker.metrics import WorkerCounters, render
from pdserve.worker.protocol import (
    DecodeRequest,
    FaultPlanBody,
    FaultState,
    GenerateRequest,
    InjectedFaultModel,
    KVAbortRequest,
    KVAbortResult,
    PrefillRequest,
    PrefillResult,
    ReleaseRequest,
    ReleaseResult,
    RenewRequest,
    RenewResult,
    ReserveRequest,
    TokenEvent,
    WorkerEventModel,
    WorkerEvents,
    WorkerHealth,
)
from pdserve.worker.reuse_metrics import render_reuse

M = TypeVar("M", bound=BaseModel)
NDJSON = "application/x-ndjson"


async def _parse(request: web.Request, model: type[M]) -> M:
    """The body as `model`; pydantic's ValidationError (-> 400 naming the field) otherwise."""
    return model.model_validate_json(await request.read())


def _json(body: BaseModel, status: int = 200) -> web.Response:
    return web.json_response(text=body.model_dump_json(), status=status)


def _held_kv(request_id: str) -> Callable[[Engine], tuple[list[memoryview], list[int], int]]:
    """An engine command reading a finished prefill's held KV: (views, block ids, cached)."""

    def read(engine: Engine) -> tuple[list[memoryview], list[int], int]:
        held = engine.get_request(request_id)
        ids = engine.block_ids(request_id)
        return engine.kv_block_views(request_id), ids, held.num_cached_tokens

    return read


@web.middleware
async def _close_on_fault(request: web.Request, handler: Handler) -> web.StreamResponse:
    """An injected close ends the connection with no response, as a dying worker would."""
    try:
        return await handler(request)
    except FaultClosed:
        if request.transport is not None:
            request.transport.close()
        # Not an error to render: aiohttp treats a cancelled handler as a client that left.
        raise asyncio.CancelledError from None


class WorkerAPI:
    """Handlers of one worker; `app()` builds the aiohttp application."""

    def __init__(
        self,
        config: WorkerConfig,
        info: EngineInfo,
        engine: EngineLoop,
        leases: LeaseKeeper,
        inbox: KVInbox | None,
        outbox: KVOutbox | None,
        faults: FaultInjector | None = None,
        events: EventRing | None = None,
        kv_streams: KVEventStreams | None = None,
    ) -> None:
        self.config = config
        self.worker_id = config.worker_id
        self.info = info
        self.engine = engine
        self.leases = leases
        self.inbox = inbox
        self.outbox = outbox
        # Fault injection (tests only): None unless enabled, and then every site is skipped.
        self.faults = faults
        # This worker's timeline events of recent requests (GET /debug/requests/{id}).
        self.events = events if events is not None else EventRing(config.worker_id)
        # POST /kv_events (None: not served, e.g. an API built without an engine's log).
        self.kv_streams = kv_streams

    def app(self) -> web.Application:
        """The application with every route of the protocol (+ /admin/faults if enabled)."""
        middlewares = [error_middleware(self.worker_id)]
        if self.faults is not None:
            middlewares.append(_close_on_fault)  # inner: runs before errors are rendered
        app = web.Application(middlewares=middlewares)
        app.add_routes(
            [
                web.get("/health", self.health),
                web.post("/reserve", self.reserve),
                web.post("/prefill", self.prefill),
                web.post("/decode", self.decode),
                web.post("/generate", self.generate),
                web.post("/release", self.release),
                web.post("/kv_abort", self.kv_abort),
                web.post("/renew", self.renew),
                web.get("/metrics", self.metrics),
                web.get("/debug/requests/{request_id}", self.debug_request),
            ]
        )
        if self.kv_streams is not None:
            app.add_routes([web.post("/kv_events", self.kv_streams.handle)])
        if self.config.enable_fault_admin:
            app.add_routes(
                [
                    web.get("/admin/faults", self.get_faults),
                    web.post("/admin/faults", self.set_faults),
                    web.delete("/admin/faults", self.clear_faults),
                ]
            )
        return app

    # ---- helpers ---------------------------------------------------------------------------

    def _need_inbox(self, endpoint: str) -> KVInbox:
        if self.inbox is None:
            raise WrongRole(
                f"worker {self.worker_id} (role {self.config.role}) does not serve {endpoint}"
            )
        return self.inbox

    def _need_outbox(self, endpoint: str) -> KVOutbox:
        if self.outbox is None:
            raise WrongRole(
                f"worker {self.worker_id} (role {self.config.role}) does not serve {endpoint}"
            )
        return self.outbox

    async def _stream(
        self, queue: DeltaQueue, response: web.StreamResponse, request_id: str = ""
    ) -> None:
        first = True
        while True:
            delta = await queue.get()
            if first and delta.new_token_ids:
                first = False
                self.events.record(request_id, "first_token")
            if delta.finished:
                self.events.record(request_id, "finished", delta.finish_reason or "")
            token_ids = list(delta.new_token_ids)
            if self.faults is not None:
                token_ids = await self._token_faults(token_ids, response)
            error = "the engine failed this request" if delta.finish_reason == "error" else None
            event = TokenEvent(
                token_ids=token_ids,
                finished=delta.finished,
                finish_reason=delta.finish_reason,
                error=error,
            )
            await response.write(event.model_dump_json().encode() + b"\n")
            if delta.finished:
                return

    async def _token_faults(self, token_ids: list[int], response: web.StreamResponse) -> list[int]:
        """The `worker.decode_tokens` site, one hit per token, fired before the token is
        written: tokens ahead of a firing go out first. Returns the tokens still to write."""
        assert self.faults is not None
        written = 0
        for i in range(len(token_ids)):
            rule = self.faults.fire(FaultSite.WORKER_DECODE_TOKENS)
            if rule is None:
                continue
            if i > written:
                event = TokenEvent(token_ids=token_ids[written:i])
                await response.write(event.model_dump_json().encode() + b"\n")
                written = i
            await perform(rule)
        return token_ids[written:]

    async def _open_stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": NDJSON})
        await response.prepare(request)
        return response

    # ---- endpoints -------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """GET /health -> WorkerHealth."""
        arrived_ns = time.monotonic_ns()
        stats = await self.engine.stats()
        info = self.info
        body = WorkerHealth(
            worker_id=self.worker_id,
            role=self.config.role,  # type: ignore[arg-type]  # validated by WorkerConfig
            pid=os.getpid(),
            fingerprint=info.fingerprint,
            fingerprint_digest=info.fingerprint_digest,
            transfer_address=self.inbox.address if self.inbox is not None else None,
            max_model_len=info.max_model_len,
            block_size=info.block_size,
            num_blocks=stats.num_blocks,
            num_free_blocks=stats.num_free_blocks,
            num_pinned_blocks=stats.num_held_blocks,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_active_leases=self.leases.num_active,
            request_monotonic_ns=arrived_ns,
            monotonic_ns=time.monotonic_ns(),
            wall_time_s=time.time(),
        )
        return _json(body)

    async def reserve(self, request: web.Request) -> web.Response:
        """POST /reserve ReserveRequest -> Reservation."""
        inbox = self._need_inbox("/reserve")
        body = await _parse(request, ReserveRequest)
        if self.faults is not None and (rule := self.faults.fire(FaultSite.WORKER_RESERVE)):
            await perform(rule)
        return _json(await inbox.reserve(body))

    async def prefill(self, request: web.Request) -> web.Response:
        """POST /prefill PrefillRequest -> PrefillResult; the KV send continues after."""
        outbox = self._need_outbox("/prefill")
        body = await _parse(request, PrefillRequest)
        rid = body.request_id
        params = body.sampling.to_params()
        destination = (
            Destination.parse(body.reservation, body.decode_url) if body.reservation else None
        )
        if self.faults is not None and (rule := self.faults.fire(FaultSite.WORKER_PREFILL)):
            await perform(rule)
        start_ns = self.events.record(rid, "prefill_start").monotonic_ns
        # One token, sampled with the request's own params (seed included): the sampler keys
        # token 0's randomness by (seed, 0), so it is the token a colocated run draws.
        queue = await self.engine.add(
            rid, body.prompt_token_ids, dataclasses.replace(params, max_tokens=1), hold_kv=True
        )
        handed_over = False
        try:
            delta = await queue.get()
            if not delta.new_token_ids:
                raise EngineError(
                    f"request {rid}: prefill ended without a token ({delta.finish_reason})"
                )
            end_ns = self.events.record(rid, "prefill_end").monotonic_ns
            views, block_ids, num_cached = await self.engine.call(_held_kv(rid))
            if destination is not None:
                outbox.start(
                    rid, body.prompt_token_ids, views, block_ids, destination, body.lease_ttl_s
                )
                handed_over = True
        finally:
            if not handed_over:
                await self.engine.abort(rid)  # frees held KV too: nothing to send it to
        if self.faults is not None and (rule := self.faults.fire(FaultSite.WORKER_PREFILL_REPLY)):
            await perform(rule)
        return _json(
            PrefillResult(
                request_id=rid,
                first_token_id=delta.new_token_ids[0],
                num_prompt_tokens=len(body.prompt_token_ids),
                num_cached_tokens=num_cached,
                prefill_start_ns=start_ns,
                prefill_end_ns=end_ns,
            )
        )

    async def decode(self, request: web.Request) -> web.StreamResponse:
        """POST /decode DecodeRequest -> NDJSON TokenEvents from the second token on."""
        inbox = self._need_inbox("/decode")
        body = await _parse(request, DecodeRequest)
        rid = body.request_id
        if not inbox.has(rid):
            raise RequestNotFound(f"no reservation for request {rid} (never made, expired or done)")
        response = await self._open_stream(request)
        done = False
        try:
            try:
                await inbox.take(rid, body.kv_timeout_s)
                queue = await self.engine.mark_ready(rid, body.first_token_id)
                self.events.record(rid, "decode_start")
            except PdserveError as exc:
                await inbox.cancel(rid, f"{type(exc).__name__}: {exc}")
                await self.engine.abort(rid)
                event = TokenEvent(
                    token_ids=[],
                    finished=True,
                    finish_reason="error",
                    error=f"{type(exc).__name__}: {exc}",
                )
                await response.write(event.model_dump_json().encode() + b"\n")
                done = True
                return response
            await self._stream(queue, response, rid)
            done = True
        finally:
            if not done:  # the client went away: nobody will read the rest
                await inbox.cancel(rid, "client disconnected")
                await self.engine.abort(rid)
        await response.write_eof()
        return response

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """POST /generate GenerateRequest -> NDJSON TokenEvents (colocated, resume, recompute).

        Served by every worker that decodes: a decode worker runs it to resume a migrated
        request or to prefill locally when no prefill worker could."""
        if not self.config.serves_decode:
            raise WrongRole(
                f"worker {self.worker_id} (role {self.config.role}) does not serve /generate"
            )
        body = await _parse(request, GenerateRequest)
        self.events.record(
            body.request_id, "generate_start", f"resume_after={len(body.output_token_ids)}"
        )
        queue = await self.engine.add(
            body.request_id,
            body.prompt_token_ids,
            body.sampling.to_params(),
            output_token_ids=body.output_token_ids,
        )
        done = False
        try:
            response = await self._open_stream(request)
            await self._stream(queue, response, body.request_id)
            done = True
        finally:
            if not done:
                await self.engine.abort(body.request_id)
        await response.write_eof()
        return response

    async def renew(self, request: web.Request) -> web.Response:
        """POST /renew: keep a reservation alive while its prefill runs elsewhere."""
        inbox = self._need_inbox("/renew")
        body = await _parse(request, RenewRequest)
        ttl_s = inbox.renew(body.request_id)
        return _json(RenewResult(request_id=body.request_id, lease_ttl_s=ttl_s))

    async def kv_abort(self, request: web.Request) -> web.Response:
        """POST /kv_abort: the sender gave this reservation's KV up; cancel it now."""
        inbox = self._need_inbox("/kv_abort")
        body = await _parse(request, KVAbortRequest)
        cancelled = await inbox.abort(body)
        return _json(KVAbortResult(request_id=body.request_id, cancelled=cancelled))

    async def release(self, request: web.Request) -> web.Response:
        """POST /release: free whatever this worker holds for the request (idempotent)."""
        body = await _parse(request, ReleaseRequest)
        rid = body.request_id
        num_freed = 0
        if self.outbox is not None:
            # Cancel the send before freeing: it must never read blocks that were reused.
            self.outbox.cancel(rid)
        if self.inbox is not None:
            num_freed += await self.inbox.cancel(rid, "released")
        num_freed += await self.engine.abort(rid)
        return _json(ReleaseResult(request_id=rid, num_freed_blocks=num_freed))

    async def metrics(self, request: web.Request) -> web.Response:
        """GET /metrics: Prometheus text."""
        stats = await self.engine.stats()
        receiver = self.inbox.receiver if self.inbox is not None else None
        counters = WorkerCounters(
            transfers_sent=self.outbox.num_sent if self.outbox else 0,
            transfers_send_failed=self.outbox.num_failed if self.outbox else 0,
            transfers_received=receiver.num_verified if receiver else 0,
            transfer_attempts_refused=receiver.num_failed_attempts if receiver else 0,
            reservations_cancelled=self.inbox.num_cancelled if self.inbox else 0,
            lease_expiries=self.leases.num_expired_total,
            kv_send_retries=self.outbox.num_send_retries if self.outbox else 0,
            refusals_by_reason=dict(receiver.failed_attempts_by_reason) if receiver else {},
            lease_expiries_by_kind=dict(self.leases.expired_by_kind),
            num_reserved_blocks=self.inbox.num_reserved_blocks if self.inbox else 0,
        )
        sends = self.outbox.sends if self.outbox else None
        text = render(self.worker_id, stats, self.leases.num_active, counters, sends)
        text += render_reuse(self.worker_id, stats)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def debug_request(self, request: web.Request) -> web.Response:
        """GET /debug/requests/{id} -> WorkerEvents (suffixed ids `.rN`, `.mN` included)."""
        arrived_ns = time.monotonic_ns()
        events = self.events.events_for(request.match_info["request_id"])
        return _json(
            WorkerEvents(
                worker_id=self.worker_id,
                role=self.config.role,  # type: ignore[arg-type]  # validated by WorkerConfig
                request_monotonic_ns=arrived_ns,
                monotonic_ns=time.monotonic_ns(),
                wall_time_s=time.time(),
                events=[
                    WorkerEventModel(
                        request_id=e.request_id,
                        event=e.event,
                        monotonic_ns=e.monotonic_ns,
                        wall_time_s=e.wall_time_s,
                        detail=e.detail,
                    )
                    for e in events
                ],
            )
        )

    # ---- fault admin (only with enable_fault_admin) ---------------------------------------

    def _fault_state(self) -> FaultState:
        assert self.faults is not None  # built whenever the admin routes exist
        return FaultState(
            rules=[rule.spec() for rule in self.faults.rules],
            seed=self.faults.seed,
            injected=[
                InjectedFaultModel(site=i.site.value, hit=i.hit, action=i.action.value)
                for i in self.faults.injected
            ],
            hits={site.value: n for site, n in self.faults.hits.items()},
        )

    async def get_faults(self, request: web.Request) -> web.Response:
        """GET /admin/faults -> FaultState."""
        return _json(self._fault_state())

    async def set_faults(self, request: web.Request) -> web.Response:
        """POST /admin/faults FaultPlanBody -> FaultState; a bad rule is 400, naming it."""
        assert self.faults is not None
        body = await _parse(request, FaultPlanBody)
        self.faults.reset(parse_rules(body.rules), body.seed)
        return _json(self._fault_state())

    async def clear_faults(self, request: web.Request) -> web.Response:
        """DELETE /admin/faults -> FaultState of the empty plan."""
        assert self.faults is not None
        self.faults.reset()
        return _json(self._fault_state())
