"""The router's aiohttp application: wiring, error mapping, auth, and the non-OpenAI routes.

Routes: the OpenAI ones (`openai_api`), `GET /health` (router and workers summary, mode,
automatic mode and live figures), `GET /metrics` (Prometheus), `POST /admin/mode` and
`GET /admin/auto` (`mode_control`), `GET /debug/requests/{id}` (a recent request's timeline),
`GET /debug/kv_index` (the prefix index per worker, fed by the workers' KV events through
`kv_feed`).

Life cycle: `create_app` must run inside the event loop (it opens the one shared
`aiohttp.ClientSession`); startup polls every worker once, then keeps polling; cleanup stops
polling and closes the session. Every error becomes an OpenAI-style body with its status (400
bad request, 401 missing key, 503 + Retry-After when no worker could serve it, whether none
had room or every worker tried failed past what recovery absorbs; 504 timeout), so one bad
request never takes the router down.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from pdserve.auth.tls import client_context, http_connector
from pdserve.clock import Clock, MonotonicClock
from pdserve.errors import (
    ConfigError,
    InvalidRequest,
    NoCapacity,
    WorkerCallError,
    WorkerUnreachable,
)
from pdserve.faults import FaultInjector, parse_rules
from pdserve.membership import open_membership
from pdserve.model.config import load_config
from pdserve.model.tokenizer import Tokenizer
from pdserve.observability import otel
from pdserve.observability.exposition import CONTENT_TYPE
from pdserve.protocol.worker_api import WorkerHealth, body_limit_bytes
from pdserve.router import debug_view
from pdserve.router import metrics as metrics_mod
from pdserve.router.access import check_access, is_loopback, plane_of
from pdserve.router.api.openai_routes import OpenAIApi
from pdserve.router.api.responses import error_body
from pdserve.router.api.tokenize_routes import TokenizeApi
from pdserve.router.config import Mode, RouterConfig
from pdserve.router.flows.capacity_queue import CapacityQueue
from pdserve.router.flows.colocated import ColocatedFlow
from pdserve.router.flows.disagg import DisaggFlow
from pdserve.router.flows.dispatcher import Dispatcher
from pdserve.router.flows.flow import Flow
from pdserve.router.flows.handoff_outcome import Handoff
from pdserve.router.health_view import (
    BreakerView,
    FieldDiffView,
    FingerprintGroupView,
    KVPairView,
    RouterHealth,
    WorkerSummary,
)
from pdserve.router.metrics import RouterMetrics
from pdserve.router.mode.auto_controller import AutoController
from pdserve.router.mode.breaker import CircuitBreaker
from pdserve.router.mode.control import ModeControl
from pdserve.router.mode.live_monitor import LiveMonitor
from pdserve.router.mode.roles import AssignedPool, RoleOverlay
from pdserve.router.placement.affinity import AffinityPolicy
from pdserve.router.placement.policy import (
    compatible_digest,
    fingerprint_groups,
    pairing_problems,
    rank_colocated,
    rank_decode,
)
from pdserve.router.workers.client import ClientTimeouts, WorkerClient
from pdserve.router.workers.health_watch import HealthWatch
from pdserve.router.workers.kv_feed import KVEventFeed
from pdserve.router.workers.model_check import describe, model_mismatch, router_model_fields
from pdserve.router.workers.pair_probes import PairProbe, PairProber, Verdict
from pdserve.router.workers.pool import WorkerPool

log = logging.getLogger(__name__)


class _Routes:
    """Handlers of the router's own routes."""

    def __init__(
        self,
        config: RouterConfig,
        pool: WorkerPool,
        dispatcher: Dispatcher,
        metrics: RouterMetrics,
        modes: ModeControl,
        client: WorkerClient | None = None,
        affinity: AffinityPolicy | None = None,
        feed: KVEventFeed | None = None,
        prober: PairProber | None = None,
    ) -> None:
        self._config = config
        self._pool = pool
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._modes = modes
        # Asks workers for their timeline events (None: the router's transitions only).
        self._client = client
        self._affinity = affinity
        self._feed = feed
        self._prober = prober

    async def ready(self, request: web.Request) -> web.Response:
        """GET /ready: 200 when a request of the effective mode has a worker to run on, else
        503 (a load balancer's readiness probe; /health always answers, with the details)."""
        mode = self._dispatcher.effective_mode
        views = self._pool.snapshot()
        ranked = rank_colocated(views) if mode == "colocated" else rank_decode(views)
        status = 200 if ranked else 503
        return web.json_response({"ready": bool(ranked), "mode": mode}, status=status)

    async def health(self, request: web.Request) -> web.Response:
        views = self._pool.snapshot()
        workers = [
            WorkerSummary(
                url=v.url,
                healthy=v.healthy,
                worker_id=v.health.worker_id if v.health else None,
                instance_id=(v.health.instance_id or None) if v.health else None,
                num_restarts=self._pool.num_restarts(v.url),
                role=v.health.role if v.health else None,
                assigned_role=v.assigned_role,
                fingerprint_digest=v.health.fingerprint_digest if v.health else None,
                num_free_blocks=v.health.num_free_blocks if v.health else None,
                num_running=v.health.num_running if v.health else None,
                num_inflight=v.num_inflight,
                last_error=self._pool.last_error(v.url),
            )
            for v in views
        ]
        mode = self._dispatcher.mode
        problems = pairing_problems(views, self._dispatcher.effective_mode)
        problems += self._pool.model_problems()
        groups = [
            FingerprintGroupView(
                digest=g.digest,
                compatible=g.compatible,
                workers=list(g.worker_urls),
                roles=list(g.roles),
                differs=[
                    FieldDiffView(field=d.field, value=d.value, compatible_value=d.compatible_value)
                    for d in g.differs
                ],
            )
            for g in fingerprint_groups(views)
        ]
        body = RouterHealth(
            status="degraded" if problems else "ok",
            problems=problems,
            pid=os.getpid(),
            mode=mode,
            effective_mode=self._dispatcher.effective_mode,
            mode_setting=self._modes.setting,
            breaker=self._breaker_view(),
            model=self._config.model_name,
            compatible_digest=compatible_digest(views),
            fingerprint_groups=groups,
            workers=workers,
            auto=self._modes.view(),
            membership_refused=self._pool.membership_refused,
            kv_pairs=[
                KVPairView(
                    prefill=p.prefill, decode=p.decode, verdict=p.verdict.value,
                    transport=p.transport, gbps=round(p.gbps, 4),
                    downgraded_from=p.downgraded_from, detail=p.detail,
                )
                for p in (self._prober.table() if self._prober is not None else [])
            ],
        )  # fmt: skip
        return web.json_response(text=body.model_dump_json())

    def _breaker_view(self) -> BreakerView:
        breaker = self._dispatcher.breaker
        if breaker is None:
            return BreakerView(
                enabled=False, state="closed", failure_rate=0.0, last_transition=None
            )
        last = breaker.transitions[-1] if breaker.transitions else None
        return BreakerView(
            enabled=self._config.breaker.enabled,
            state=breaker.state.value,
            failure_rate=breaker.failure_rate,
            last_transition=(
                None
                if last is None
                else f"{last.source.value} -> {last.target.value}: {last.reason}"
            ),
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self._metrics.render().encode(),
            headers={"Content-Type": CONTENT_TYPE},
        )

    async def kv_index(self, request: web.Request) -> web.Response:
        """GET /debug/kv_index: the prefix index per member worker (fed by KV events or
        inferred), with a digest of its hashes, so routers can be compared."""
        index = self._affinity.index if self._affinity is not None else None
        workers = [dataclasses.asdict(index.view(url)) for url in self._pool.urls] if index else []
        feed = self._feed
        body = {
            "workers": workers,
            "num_connects": feed.num_connects if feed else 0,
            "num_resyncs": feed.num_resyncs if feed else 0,
        }
        return web.json_response(text=json.dumps(body))

    async def timeline(self, request: web.Request) -> web.Response:
        timeline = self._dispatcher.timeline(request.match_info["request_id"])
        if timeline is None:
            raise web.HTTPNotFound(text="unknown or evicted request id")
        # ?workers=0: the router's own transitions only, no calls to the workers.
        client = None if request.query.get("workers") == "0" else self._client
        body = await debug_view.timeline_view(timeline, self._pool, client)
        return web.json_response(text=body.model_dump_json())


def _error(status: int, message: str, type_: str, **kw: str | None) -> web.Response:
    body = error_body(message, type_, kw.get("param"), kw.get("code"))
    headers = {"Retry-After": kw["retry_after"] or "1"} if "retry_after" in kw else None
    return web.json_response(text=body.model_dump_json(), status=status, headers=headers)


def _local_address(request: web.Request) -> object:
    # The address the connection arrived at (this socket's own end), not the peer's.
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    return sockname[0] if isinstance(sockname, tuple) and sockname else None


def _middleware(config: RouterConfig, dispatcher: Dispatcher, metrics: RouterMetrics) -> Middleware:
    keys = config.access_keys

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        refused = check_access(
            plane_of(request.path),
            keys,
            request.headers.get("Authorization"),
            on_loopback=is_loopback(_local_address(request)),
        )
        if refused is not None:
            type_ = "authentication_error" if refused.status == 401 else "permission_error"
            return _error(refused.status, refused.message, type_)
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge as exc:
            # aiohttp's text names the limit (which follows --max-model-len) and the size.
            return _error(413, exc.text or "request body too large", "invalid_request_error")
        except (web.HTTPException, ConnectionResetError):
            raise
        except Exception as exc:
            reply = error_reply(exc, config.request_timeout_s)
            if reply.status == 500:
                log.exception("unhandled error on %s %s", request.method, request.path)
            elif reply.status > 500:
                # The client's text leaves the worker's address out; the log keeps it.
                log.warning(
                    "%s %s answered %d: %s", request.method, request.path, reply.status, exc
                )
            if isinstance(exc, InvalidRequest):
                metrics.count_request(dispatcher.mode, "client_error")
            return _error(reply.status, reply.message, reply.type, **reply.extra)

    return middleware


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """What a client is answered for an error: status, OpenAI error type and message."""

    status: int
    message: str
    type: str
    extra: dict[str, str | None]


def error_reply(exc: BaseException, request_timeout_s: float) -> ErrorReply:
    """The client's answer for `exc` (pure). A worker's answer is never a 500 or a 502: 400
    (the request itself), 504 (out of time), else 503 + Retry-After (no room, or the workers
    failed past what recovery absorbs: worth a retry); 500 is a router bug only."""
    if isinstance(exc, InvalidRequest):
        extra: dict[str, str | None] = {"param": exc.param, "code": exc.code}
        return ErrorReply(400, exc.message, "invalid_request_error", extra)
    if isinstance(exc, NoCapacity):
        retry_after: dict[str, str | None] = {"retry_after": str(exc.retry_after_s)}
        return ErrorReply(503, exc.client_message(), "server_error", retry_after)
    if isinstance(exc, WorkerCallError):
        if exc.status == 400:
            return ErrorReply(400, exc.body.error, "invalid_request_error", {"code": exc.body.type})
        if exc.body.type == "DeadlineExceeded":
            return ErrorReply(504, exc.client_message(), "timeout", {})
        return ErrorReply(503, exc.client_message(), "server_error", {"retry_after": "1"})
    if isinstance(exc, WorkerUnreachable):
        return ErrorReply(503, exc.client_message(), "server_error", {"retry_after": "1"})
    if isinstance(exc, TimeoutError):
        return ErrorReply(504, f"request timed out after {request_timeout_s} s", "timeout", {})
    return ErrorReply(500, "internal router error (see the router log)", "server_error", {})


async def create_app(config: RouterConfig, clock: Clock | None = None) -> web.Application:
    """The router application for `config`; call inside the running event loop. `clock`
    times the breaker's cooldown (tests pass a fake one; default: the monotonic clock)."""
    tokenizer = Tokenizer(config.model)
    template = config.chat_template_text()
    if template is not None:
        tokenizer.chat_template = template
    max_model_len = load_config(config.model).max_position_embeddings
    model_fields = router_model_fields(config.model, tokenizer)
    if config.max_model_len is not None:
        if config.max_model_len > max_model_len:
            raise ConfigError(
                f"max-model-len: {config.max_model_len} exceeds the model's"
                f" max_position_embeddings {max_model_len}"
            )
        max_model_len = config.max_model_len
    membership = open_membership(config.discovery, config.workers, config.membership_key)
    session = aiohttp.ClientSession(connector=http_connector(client_context(config.tls)))
    client = WorkerClient(session, ClientTimeouts(), key=config.http_key)
    queue = CapacityQueue(config.recovery.max_queued)

    def model_check(health: WorkerHealth) -> str | None:
        diff = model_mismatch(model_fields, health.fingerprint)
        return describe(diff) if diff else None

    # Roles the router assigns to `both` workers (auto mode, `POST /admin/mode` num_prefill).
    pool = AssignedPool(
        (),
        client,
        config.health_poll_interval_s,
        membership=membership,
        model_check=model_check,
        on_capacity=queue.notify,
        overlay=RoleOverlay(),
    )
    # One placement policy for both flows: a conversation keeps its worker across modes.
    affinity = AffinityPolicy(config.affinity)
    flows: dict[Mode, Flow] = {
        "disagg": DisaggFlow(
            pool,
            client,
            tokenizer.eos_token_ids,
            recovery=config.recovery,
            lease_ttl_s=config.lease_ttl_s,
            on_kv_outcome=lambda outcome, reason: record_kv_outcome(outcome, reason),
            faults=FaultInjector(parse_rules(config.faults), config.fault_seed)
            if config.faults
            else None,
            affinity=affinity,
            reservation_key=config.reservation_key,
            queue=queue,
        ),
        "colocated": ColocatedFlow(
            pool,
            client,
            affinity,
            on_end=queue.notify,
            queue=queue,
            queue_timeout_s=config.recovery.queue_timeout_s,
        ),
    }
    breaker = CircuitBreaker(config.breaker, clock or MonotonicClock())
    metrics = RouterMetrics(breaker=breaker, workers=lambda: metrics_mod.worker_gauges(pool))
    monitor = LiveMonitor(config.slo, config.auto.window_s)
    dispatcher = Dispatcher(
        config.initial_mode,
        flows,
        breaker=breaker,
        metrics=metrics,
        max_timelines=config.timeline_ring,
        span_hook=otel.request_span_hook(),  # None unless OpenTelemetry is installed
        monitor=monitor,
    )
    controller = AutoController(
        config.auto, monitor, pool, dispatcher, enabled=config.mode == "auto"
    )
    modes = ModeControl(dispatcher, pool, controller)
    metrics.extra = [monitor.render, controller.render]

    def record_kv_outcome(outcome: Handoff, reason: str) -> None:
        metrics.kv_handoffs[outcome.value] += 1
        dispatcher.record_kv_outcome(outcome is Handoff.OK, reason)

    # Every router following the same workers' KV events holds the same prefix index.
    feed = KVEventFeed(lambda: pool.urls, client, affinity.index)
    watch = (
        HealthWatch(pool, client, config.health_deadline_s) if config.health_deadline_s else None
    )

    def pair_verdict(probe: PairProbe) -> None:
        metrics.kv_pair_probes[probe.verdict.value] += 1
        if probe.verdict in (Verdict.OK, Verdict.SLOW):  # a KV transfer: the breaker counts it
            reason = f"KV pair {probe.prefill} -> {probe.decode} {probe.verdict.value}"
            ok = probe.verdict is Verdict.OK
            dispatcher.record_kv_outcome(ok, reason if ok else f"{reason}: {probe.detail}")

    prober = None
    if config.kv_probe_mib > 0:
        prober = PairProber(
            pool,
            client,
            num_bytes=config.kv_probe_mib << 20,
            reservation_key=config.reservation_key,
            on_verdict=pair_verdict,
        )
        affinity.avoid_pairs = prober.avoid
        metrics.kv_pairs = prober.table
    app = web.Application(
        middlewares=[_middleware(config, dispatcher, metrics)],
        client_max_size=body_limit_bytes(max_model_len),
    )
    api = OpenAIApi(config, tokenizer, max_model_len, dispatcher, metrics)
    metrics.handoff_spikes = api.spikes.counts
    api.add_routes(app)
    TokenizeApi(tokenizer, max_model_len, config.accepted_model_names).add_routes(
        app, tokenizer_info=config.enable_tokenizer_info_endpoint
    )
    routes = _Routes(
        config,
        pool,
        dispatcher,
        metrics,
        modes,
        client=client,
        affinity=affinity,
        feed=feed,
        prober=prober,
    )
    app.router.add_get("/health", routes.health)
    app.router.add_get("/ready", routes.ready)
    app.router.add_get("/metrics", routes.metrics)
    app.router.add_post("/admin/mode", modes.set_mode)
    app.router.add_get("/admin/auto", modes.get_auto)
    app.router.add_get("/debug/requests/{request_id}", routes.timeline)
    app.router.add_get("/debug/kv_index", routes.kv_index)

    async def on_startup(_: web.Application) -> None:
        await pool.start()
        problems = pool.model_problems()
        if problems:
            await pool.stop()
            raise ConfigError(
                f"model: the router serves {config.model} but "
                + "; ".join(problems)
                + " (start the router with the workers' --model, or fix the workers)"
            )
        controller.start()
        await feed.start()
        if watch is not None:
            await watch.start()
        if prober is not None:
            await prober.start()

    async def on_cleanup(_: web.Application) -> None:
        if prober is not None:
            await prober.stop()
        await controller.stop()
        if watch is not None:
            await watch.stop()
        await feed.stop()
        await pool.stop()
        await session.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
