"""The worker's HTTP control API (aiohttp), exactly as `protocol.py` defines it.

Handlers parse a body into its protocol model, check the worker's role, and drive the parts:
the engine loop (every engine call), the inbox (decode-side reservations), the outbox
(prefill-side sends) and the lease keeper. Errors are raised, never rendered here: the
middleware in `http_errors` turns them into `ErrorBody` responses.

Invariants:
- Only the cluster talks to workers: every call but GET /health and /metrics carries a valid
  cluster signature (`auth_middleware`), and /prefill sends KV only to a reservation the
  router signed (`reservation_auth`).
- Reserve before release: /prefill parses and checks its reservation (signature, expiry,
  transport) before any prefill runs.
- Verified state only, checked by value: /decode schedules a request only after its KV was
  verified by checksums and, with --kv-canary (the default), recomputed and compared.
- Bounded: /prefill and /generate refuse with 503 Overloaded once `max_waiting` requests wait
  in the engine; every wait on a router's behalf ends at the call's `deadline_s`.
- No leak: a handler that leaves early (error, client gone: aiohttp cancels the handler) aborts
  whatever it had put in the engine; a finished prefill's held KV is either handed to the
  outbox (which always releases it) or released at once.
- Streams (NDJSON, one `TokenEvent` per line) end with exactly one `finished` event unless the
  client went away.

It knows HTTP, the protocol models and the worker's parts; not sockets of the KV data plane.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Iterator

from aiohttp import web
from aiohttp.typedefs import Handler

from pdserve.auth.signing import CallVerifier
from pdserve.engine.engine import Engine
from pdserve.engine.outputs import RequestDelta
from pdserve.errors import (
    Draining,
    Overloaded,
    PdserveError,
    RequestNotFound,
    WrongRole,
)
from pdserve.faults import FaultClosed, FaultInjector, FaultSite, perform
from pdserve.observability.timeline_log import EventRing
from pdserve.protocol.worker_api import (
    CheckpointPlan,
    DecodeRequest,
    GenerateRequest,
    HandoffInfo,
    KVAbortRequest,
    KVAbortResult,
    ProbeExpectRequest,
    ProbeSendRequest,
    ReleaseRequest,
    ReleaseResult,
    RenewRequest,
    RenewResult,
    ReserveRequest,
    TokenEvent,
    Transport,
    body_limit_bytes,
)
from pdserve.tasks import run_to_end
from pdserve.worker.checkpoint.prefix_source import PrefixCacheSource
from pdserve.worker.checkpoint.routes import CheckpointService
from pdserve.worker.checkpoint.stream import Replica, on_tokens
from pdserve.worker.config import WorkerConfig
from pdserve.worker.engine_loop import EngineInfo, EngineLoop
from pdserve.worker.http.auth_middleware import auth_middleware
from pdserve.worker.http.bodies import json_body, parse_body
from pdserve.worker.http.error_status import error_middleware
from pdserve.worker.http.observe_routes import ObserveRoutes
from pdserve.worker.http.prefill import Prefills
from pdserve.worker.http.token_stream import TokenStreamer, end_stream
from pdserve.worker.kv import canary as kv_canary
from pdserve.worker.kv.events import KVEventStreams
from pdserve.worker.kv.inbox import KVInbox, Received
from pdserve.worker.kv.outbox import KVOutbox
from pdserve.worker.lease_keeper import LeaseKeeper


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
        verifier: CallVerifier | None = None,
        local_transports: tuple[Transport, ...] = ("tcp",),
        kv_streams: KVEventStreams | None = None,
        checkpoints: CheckpointService | None = None,
        cache_source: PrefixCacheSource | None = None,
        instance_id: str = "",
    ) -> None:
        self.config = config
        # This process's life at its address (drawn at start; /health and membership carry it).
        self.instance_id = instance_id
        # Draining (`worker/drain.py`): /health says so from the start (`draining`), `drain_seen`
        # is set once a /health has said so, and new work is refused from then (`refusing`);
        # `on_drain` starts a drain (POST /admin/drain).
        self.draining = False
        self.refusing = False
        self.drain_seen = asyncio.Event()
        self.on_drain: Callable[[], None] | None = None
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
        # Checks every control call's cluster signature; None: --insecure-no-auth.
        self.verifier = verifier
        # KV transports this worker can send over, best first (prefill side).
        self.local_transports = local_transports
        self.canary_counts: Counter[str] = Counter()
        self.num_admission_refusals = 0
        # Requests this worker admitted into its engine (/prefill, /generate) and not ended.
        self.num_admitted = 0
        self.streams = TokenStreamer(engine, self.events, faults)
        self.observe = ObserveRoutes(self)
        self.prefills = Prefills(
            config, engine, self.events, faults, local_transports, self._admitted
        )
        # POST /kv_events (None: not served, e.g. an API built without an engine's log).
        self.kv_streams = kv_streams
        # Decode checkpoints: holder, replicas, resume pulls (None: a prefill-only worker).
        self.checkpoints = checkpoints
        # This worker's prefix cache as a resume's source (/cache/*; None: caching off).
        self.cache_source = cache_source

    def app(self) -> web.Application:
        """The application with every route of the protocol (+ /admin/faults if enabled)."""
        middlewares = [error_middleware(self.worker_id), auth_middleware(self.verifier)]
        if self.faults is not None:
            middlewares.append(_close_on_fault)  # inner: runs before errors are rendered
        app = web.Application(
            middlewares=middlewares, client_max_size=body_limit_bytes(self.info.max_model_len)
        )
        observe = self.observe
        app.add_routes(
            [
                web.get("/health", observe.health),
                web.post("/reserve", self.reserve),
                web.post("/prefill", self.prefill),
                web.post("/decode", self.decode),
                web.post("/generate", self.generate),
                web.post("/release", self.release),
                web.post("/kv_abort", self.kv_abort),
                web.post("/renew", self.renew),
                web.get("/metrics", observe.metrics),
                web.get("/debug/requests/{request_id}", observe.debug_request),
                web.post("/admin/drain", self.admin_drain),
                web.post("/kv_probe/expect", self.probe_expect),
                web.post("/kv_probe/send", self.probe_send),
            ]
        )
        if self.kv_streams is not None:
            app.add_routes([web.post("/kv_events", self.kv_streams.handle)])
        if self.checkpoints is not None:
            app.add_routes(self.checkpoints.routes())
        if self.cache_source is not None:
            app.add_routes(self.cache_source.routes())
        if self.config.enable_fault_admin:
            app.add_routes(
                [
                    web.get("/admin/faults", observe.get_faults),
                    web.post("/admin/faults", observe.set_faults),
                    web.delete("/admin/faults", observe.clear_faults),
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

    # ---- endpoints -------------------------------------------------------------------------

    async def prefill(self, request: web.Request) -> web.Response:
        """POST /prefill (`Prefills.handle`): a prefill worker's one job."""
        return await self.prefills.handle(request, self._need_outbox("/prefill"))

    async def reserve(self, request: web.Request) -> web.Response:
        """POST /reserve ReserveRequest -> Reservation."""
        inbox = self._need_inbox("/reserve")
        body = await parse_body(request, ReserveRequest)
        self._refuse_if_draining(body.request_id)
        if self.faults is not None and (rule := self.faults.fire(FaultSite.WORKER_RESERVE)):
            await perform(rule)
        return json_body(await inbox.reserve(body))

    async def probe_expect(self, request: web.Request) -> web.Response:
        """POST /kv_probe/expect ProbeExpectRequest -> Reservation (`worker/kv/probe.py`)."""
        inbox = self._need_inbox("/kv_probe/expect")
        body = await parse_body(request, ProbeExpectRequest)
        return json_body(inbox.probes.expect(body))

    async def probe_send(self, request: web.Request) -> web.Response:
        """POST /kv_probe/send ProbeSendRequest -> ProbeResult: throwaway KV, timed, to a
        probe reservation the router signed (checked as a handoff's is)."""
        outbox = self._need_outbox("/kv_probe/send")
        body = await parse_body(request, ProbeSendRequest)
        destination = self.prefills.destination(body.reservation)
        return json_body(await outbox.probe(destination, body.num_bytes))

    def _refuse_if_draining(self, request_id: str) -> None:
        if self.refusing:
            raise Draining(
                f"worker {self.worker_id} is draining: {request_id} not admitted (another"
                " worker can take it)"
            )

    async def admin_drain(self, request: web.Request) -> web.Response:
        """POST /admin/drain: finish what is held, take nothing new, then exit (signed)."""
        if self.on_drain is None:
            raise WrongRole(f"worker {self.worker_id}: this worker cannot drain on request")
        if not self.draining:
            self.on_drain()
        return web.json_response({"worker_id": self.worker_id, "draining": True})

    @contextlib.contextmanager
    def _admitted(self, request_id: str) -> Iterator[None]:
        """Count a request in the engine for as long as the block runs; refuse it (503,
        Retry-After) when `max_num_seqs` run and `max_waiting` more already wait."""
        self._refuse_if_draining(request_id)
        limit = self.config.engine.max_num_seqs + self.config.max_waiting
        if self.num_admitted >= limit:
            self.num_admission_refusals += 1
            raise Overloaded(
                f"worker {self.worker_id}: {self.num_admitted} requests in the engine"
                f" (--max-num-seqs {self.config.engine.max_num_seqs} running +"
                f" --max-waiting {self.config.max_waiting}); {request_id} not admitted"
            )
        self.num_admitted += 1
        try:
            yield
        finally:
            self.num_admitted -= 1

    def _handoff_check(
        self, rid: str, received: Received
    ) -> tuple[Callable[[], HandoffInfo], Callable[[Engine], object] | None]:
        """How the KV came (read it after the check ran) and the value check (the canary) to
        run on the engine thread before the request is scheduled (None: no check)."""
        result = ["none" if not received.num_blocks else "off"]

        def info() -> HandoffInfo:
            return HandoffInfo(
                transport=received.transport,
                num_bytes=received.num_bytes,
                seconds=round(received.seconds, 6),
                slow=received.slow,
                canary=result[0],
            )

        if not received.num_blocks or not self.config.kv_canary:
            return info, None
        run = kv_canary.checker(rid, received.value_digest, self.info.dtype, self.canary_counts)

        def check(engine: Engine) -> None:
            result[0] = run(engine)

        return info, check

    async def decode(self, request: web.Request) -> web.StreamResponse:
        """POST /decode DecodeRequest -> NDJSON TokenEvents from the second token on."""
        inbox = self._need_inbox("/decode")
        body = await parse_body(request, DecodeRequest)
        rid = body.request_id
        if not inbox.has(rid):
            raise RequestNotFound(f"no reservation for request {rid} (never made, expired or done)")
        response = await self.streams.open(request)
        done = False
        kv_timeout_s = min(body.kv_timeout_s, body.deadline_s or body.kv_timeout_s)
        try:
            try:
                received = await inbox.take(rid, kv_timeout_s)
                handoff_info, check = self._handoff_check(rid, received)
                queue = await self.engine.mark_ready(rid, body.first_token_id, check)
                handoff = handoff_info()
                self.events.record(rid, "decode_start", f"canary={handoff.canary}")
            except PdserveError as exc:
                # cancel() waits for a cancellation already under way (the writer fenced)
                # before anything is freed; after a hand-over it is a no-op and abort frees.
                await inbox.cancel(rid, f"{type(exc).__name__}: {exc}")
                await self.engine.abort(rid)
                await self.streams.error(response, exc)
                done = True
                return response
            await self.streams.write(response, TokenEvent(token_ids=[], handoff=handoff))
            replica = await self._open_replica(
                rid, body.checkpoint, [body.first_token_id], computed=True
            )
            try:
                await self.streams.stream(
                    queue, response, rid, body.deadline_s, on_tokens(replica, None)
                )
            finally:
                if replica is not None:
                    await replica.close()
            done = True
        finally:
            if not done:  # the client went away: nobody will read the rest
                self.events.record(rid, "aborted", "client disconnected")
                await run_to_end(self._drop(rid, inbox))
        await end_stream(response)
        return response

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """POST /generate GenerateRequest -> NDJSON TokenEvents (colocated, resume, recompute).

        Served by every worker that decodes: a decode worker runs it to resume a migrated
        request or to prefill locally when no prefill worker could."""
        if not self.config.serves_decode:
            raise WrongRole(
                f"worker {self.worker_id} (role {self.config.role}) does not serve /generate"
            )
        body = await parse_body(request, GenerateRequest)
        with self._admitted(body.request_id):
            self.events.record(
                body.request_id, "generate_start", f"resume_after={len(body.output_token_ids)}"
            )
            # A resume first pulls its checkpoint into the prefix cache (never fails).
            first, num_adopted = await self._pull_checkpoint(body)
            queue = await self.engine.add(
                body.request_id,
                body.prompt_token_ids,
                body.sampling,
                output_token_ids=body.output_token_ids,
            )
            done = False
            replica: Replica | None = None
            try:
                response = await self.streams.open(request)
                # Not scheduled yet (no blocks): the replica starts with the first tokens.
                replica = await self._open_replica(
                    body.request_id,
                    body.checkpoint,
                    body.output_token_ids,
                    num_adopted,
                    computed=False,
                )
                await self.streams.stream(
                    queue, response, body.request_id, body.deadline_s, on_tokens(replica, first)
                )
                done = True
            finally:
                if not done:
                    self.events.record(body.request_id, "aborted", "client disconnected")
                    await run_to_end(self._drop(body.request_id, None, replica))
                elif replica is not None:
                    await replica.close()
            await end_stream(response)
            return response

    async def _drop(self, rid: str, inbox: KVInbox | None, replica: Replica | None = None) -> None:
        """A stream nobody reads on (the client hung up): its replica closed, its reservation
        cancelled and the engine request aborted. Run to its end even when aiohttp cancels the
        handler mid-way, or the engine would decode for nobody."""
        if replica is not None:
            await replica.close()
        if inbox is not None:
            await inbox.cancel(rid, "client disconnected")
        await self.engine.abort(rid)

    async def _open_replica(
        self,
        rid: str,
        plan: CheckpointPlan | None,
        outputs: list[int],
        num_sent: int = 0,
        *,
        computed: bool,
    ) -> Replica | None:
        """Start replicating the request's KV to its holder (None: no plan)."""
        if plan is None or self.checkpoints is None:
            return None
        return await self.checkpoints.open_replica(rid, plan, outputs, num_sent, computed)

    async def _pull_checkpoint(
        self, body: GenerateRequest
    ) -> tuple[Callable[[RequestDelta], None] | None, int]:
        """A resume's checkpoint pull (`CheckpointService.pull_for`)."""
        if body.checkpoint_from is None or self.checkpoints is None:
            return None, 0
        return await self.checkpoints.pull_for(body, self.events)

    async def renew(self, request: web.Request) -> web.Response:
        """POST /renew: keep a reservation alive while its prefill runs elsewhere."""
        inbox = self._need_inbox("/renew")
        body = await parse_body(request, RenewRequest)
        ttl_s = inbox.renew(body.request_id)
        return json_body(RenewResult(request_id=body.request_id, lease_ttl_s=ttl_s))

    async def kv_abort(self, request: web.Request) -> web.Response:
        """POST /kv_abort: the sender gave this reservation's KV up; cancel it now."""
        inbox = self._need_inbox("/kv_abort")
        body = await parse_body(request, KVAbortRequest)
        cancelled = await inbox.abort(body)
        return json_body(KVAbortResult(request_id=body.request_id, cancelled=cancelled))

    async def release(self, request: web.Request) -> web.Response:
        """POST /release: free whatever this worker holds for the request (idempotent)."""
        body = await parse_body(request, ReleaseRequest)
        rid = body.request_id
        num_freed = 0
        if self.outbox is not None:
            # The send ends before anything is freed: it must never read reused blocks.
            await self.outbox.cancel(rid)
        if self.inbox is not None:
            num_freed += await self.inbox.cancel(rid, "released")
        num_freed += await self.engine.abort(rid)
        return json_body(ReleaseResult(request_id=rid, num_freed_blocks=num_freed))
