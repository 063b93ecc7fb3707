"""The router's aiohttp application: wiring, error mapping, auth, and the non-OpenAI routes.

Routes: the OpenAI ones (`openai_api`), `GET /health` (router and workers summary, mode),
`GET /metrics` (Prometheus), `POST /admin/mode {"mode": "disagg"|"colocated"}`,
`GET /debug/requests/{id}` (a recent request's timeline), `GET /debug/kv_index` (the prefix
index per worker, fed by the workers' KV events through `kv_feed`).

Life cycle: `create_app` must run inside the event loop (it opens the one shared
`aiohttp.ClientSession`); startup polls every worker once, then keeps polling; cleanup stops
polling and closes the session. Every error becomes an OpenAI-style body with its status (400
bad request, 401 missing key, 503 + Retry-After no capacity, 502 worker failure, 504 timeout),
so one bad request never takes the router down.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import os
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Middleware
from pydantic import BaseModel, ValidationError

from pdserve.clock import MonotonicClock
from pdserve.errors import InvalidRequest, NoCapacity, WorkerCallError, WorkerUnreachable
from pdserve.faults import FaultInjector, parse_rules
from pdserve.membership import open_membership
from pdserve.model.config import load_config
from pdserve.model.tokenizer import Tokenizer
from pdserve.observability import otel
from pdserve.router import debug_view
from pdserve.router import metrics as metrics_mod
from pdserve.router.affinity import AffinityPolicy
from pdserve.router.breaker import CircuitBreaker
from pdserve.router.colocated import ColocatedFlow
from pdserve.router.config import Mode, RouterConfig
from pdserve.router.disagg import DisaggFlow
from pdserve.router.dispatcher import Dispatcher
from pdserve.router.flow import Flow
from pdserve.router.health_watch import HealthWatch
from pdserve.router.kv_feed import KVEventFeed
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai_api import OpenAIApi, error_body
from pdserve.router.policy import (
    compatible_digest,
    fingerprint_groups,
    pairing_problems,
    rank_colocated,
    rank_decode,
)
from pdserve.router.pool import WorkerPool
from pdserve.router.worker_client import ClientTimeouts, WorkerClient

log = logging.getLogger(__name__)
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class WorkerSummary(BaseModel):
    """One worker in GET /health."""

    url: str
    healthy: bool
    worker_id: str | None
    role: str | None
    fingerprint_digest: str | None
    num_free_blocks: int | None
    num_running: int | None
    num_inflight: int
    last_error: str | None


class FieldDiffView(BaseModel):
    """A fingerprint field on which a group differs from the compatible one."""

    field: str
    value: str | int | float | None
    compatible_value: str | int | float | None


class FingerprintGroupView(BaseModel):
    """Healthy workers with one fingerprint; only the compatible group is ever paired."""

    digest: str
    compatible: bool
    workers: list[str]
    roles: list[str]
    differs: list[FieldDiffView]


class RouterHealth(BaseModel):
    """GET /health."""

    # "ok" when requests of the effective mode can be served as configured, else "degraded"
    # with the reasons in `problems` (e.g. pools whose fingerprints cannot pair).
    status: str
    problems: list[str]
    pid: int
    # The operator's mode, and the one new requests get now (colocated while the breaker is open).
    mode: Mode
    effective_mode: Mode
    breaker: BreakerView
    model: str
    compatible_digest: str | None
    fingerprint_groups: list[FingerprintGroupView]
    workers: list[WorkerSummary]


class BreakerView(BaseModel):
    """The KV-path circuit breaker in GET /health."""

    enabled: bool
    state: str
    failure_rate: float
    last_transition: str | None


class ModeChange(BaseModel):
    """POST /admin/mode body and answer."""

    mode: Mode
    previous: Mode | None = None


class _Routes:
    """Handlers of the router's own routes."""

    def __init__(
        self,
        config: RouterConfig,
        pool: WorkerPool,
        dispatcher: Dispatcher,
        metrics: RouterMetrics,
        client: WorkerClient | None = None,
        affinity: AffinityPolicy | None = None,
        feed: KVEventFeed | None = None,
    ) -> None:
        self._config = config
        self._pool = pool
        self._dispatcher = dispatcher
        self._metrics = metrics
        # Asks workers for their timeline events (None: the router's transitions only).
        self._client = client
        self._affinity = affinity
        self._feed = feed

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
                role=v.health.role if v.health else None,
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
            breaker=self._breaker_view(),
            model=self._config.model_name,
            compatible_digest=compatible_digest(views),
            fingerprint_groups=groups,
            workers=workers,
        )
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
            headers={"Content-Type": metrics_mod.CONTENT_TYPE},
        )

    async def set_mode(self, request: web.Request) -> web.Response:
        try:
            change = ModeChange.model_validate_json(await request.read())
        except ValidationError as exc:
            raise InvalidRequest(f"mode: {exc.errors()[0]['msg']}", "mode") from exc
        previous = self._dispatcher.set_mode(change.mode)
        log.info("mode %s -> %s", previous, change.mode)
        return web.json_response(
            text=ModeChange(mode=change.mode, previous=previous).model_dump_json()
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


def _middleware(config: RouterConfig, dispatcher: Dispatcher, metrics: RouterMetrics) -> Middleware:
    @web.middleware
    async def middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
        if config.api_key is not None and request.path.startswith(("/v1/", "/admin/")):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
                return _error(401, "missing or wrong API key", "authentication_error")
        try:
            return await handler(request)
        except InvalidRequest as exc:
            metrics.count_request(dispatcher.mode, "client_error")
            return _error(400, exc.message, "invalid_request_error", param=exc.param, code=exc.code)
        except NoCapacity as exc:
            return _error(503, str(exc), "server_error", retry_after=str(exc.retry_after_s))
        except WorkerCallError as exc:
            if exc.status == 400:
                return _error(400, exc.body.error, "invalid_request_error", code=exc.body.type)
            if exc.status == 503:
                return _error(503, str(exc), "server_error", retry_after="1")
            return _error(502, str(exc), "server_error")
        except WorkerUnreachable as exc:
            return _error(502, str(exc), "server_error")
        except TimeoutError:
            return _error(504, f"request timed out after {config.request_timeout_s} s", "timeout")
        except (web.HTTPException, ConnectionResetError):
            raise
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return _error(500, "internal router error (see the router log)", "server_error")

    return middleware


async def create_app(config: RouterConfig) -> web.Application:
    """The router application for `config`; call inside the running event loop."""
    tokenizer = Tokenizer(config.model)
    max_model_len = load_config(config.model).max_position_embeddings
    membership = open_membership(config.discovery, config.workers)
    session = aiohttp.ClientSession()
    client = WorkerClient(session, ClientTimeouts())
    pool = WorkerPool((), client, config.health_poll_interval_s, membership=membership)
    # One placement policy for both flows: a conversation keeps its worker across modes.
    affinity = AffinityPolicy(config.affinity)
    flows: dict[Mode, Flow] = {
        "disagg": DisaggFlow(
            pool,
            client,
            tokenizer.eos_token_ids,
            recovery=config.recovery,
            lease_ttl_s=config.lease_ttl_s,
            on_kv_outcome=lambda ok, reason: record_kv_outcome(ok, reason),
            faults=FaultInjector(parse_rules(config.faults), config.fault_seed)
            if config.faults
            else None,
            affinity=affinity,
        ),
        "colocated": ColocatedFlow(pool, client, affinity),
    }
    breaker = CircuitBreaker(config.breaker, MonotonicClock())
    metrics = RouterMetrics(breaker=breaker, workers=lambda: metrics_mod.worker_gauges(pool))
    dispatcher = Dispatcher(
        config.mode,
        flows,
        breaker=breaker,
        metrics=metrics,
        max_timelines=config.timeline_ring,
        span_hook=otel.request_span_hook(),  # None unless OpenTelemetry is installed
    )

    def record_kv_outcome(ok: bool, reason: str) -> None:
        metrics.kv_handoffs["ok" if ok else "failed"] += 1
        dispatcher.record_kv_outcome(ok, reason)

    # Every router following the same workers' KV events holds the same prefix index.
    feed = KVEventFeed(lambda: pool.urls, client, affinity.index)
    watch = (
        HealthWatch(pool, client, config.health_deadline_s) if config.health_deadline_s else None
    )
    app = web.Application(middlewares=[_middleware(config, dispatcher, metrics)])
    api = OpenAIApi(config, tokenizer, max_model_len, dispatcher, metrics)
    metrics.handoff_spikes = api.spikes.counts
    api.add_routes(app)
    routes = _Routes(config, pool, dispatcher, metrics, client=client, affinity=affinity, feed=feed)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/ready", routes.ready)
    app.router.add_get("/metrics", routes.metrics)
    app.router.add_post("/admin/mode", routes.set_mode)
    app.router.add_get("/debug/requests/{request_id}", routes.timeline)
    app.router.add_get("/debug/kv_index", routes.kv_index)

    async def on_startup(_: web.Application) -> None:
        await pool.start()
        await feed.start()
        if watch is not None:
            await watch.start()

    async def on_cleanup(_: web.Application) -> None:
        if watch is not None:
            await watch.stop()
        await feed.stop()
        await pool.stop()
        await session.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app
