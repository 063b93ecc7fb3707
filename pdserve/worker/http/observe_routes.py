"""The worker's read-mostly routes: GET /health, GET /metrics, GET /debug/requests/{id}, and the
fault admin (GET/POST/DELETE /admin/faults, only with --enable-fault-admin).

They read the parts `WorkerAPI` holds (engine stats, leases, inbox, outbox, the fail-closed
counters) and change nothing but the fault plan. /health and /metrics are open (probes and
scrapes cannot sign); the others need the cluster credential like every control call.

It knows HTTP, the protocol models and what each part counts; not how the parts work.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from aiohttp import web

from pdserve.faults import parse_rules
from pdserve.observability.exposition import render_text
from pdserve.protocol.worker_api import KVEndpoint, WorkerHealth
from pdserve.protocol.worker_observe import (
    FaultPlanBody,
    FaultState,
    InjectedFaultModel,
    WorkerEventModel,
    WorkerEvents,
)
from pdserve.worker.kv.transport_stats import TransportStats
from pdserve.worker.metrics import (
    FailClosedCounters,
    WorkerCounters,
    render,
    render_fail_closed,
)
from pdserve.worker.reuse_metrics import render_reuse
from pdserve.worker.step_report import render_steps, step_totals_model

if TYPE_CHECKING:
    from pdserve.worker.http.app import WorkerAPI


def _json(body: WorkerHealth | WorkerEvents | FaultState) -> web.Response:
    return web.json_response(text=body.model_dump_json())


class ObserveRoutes:
    """Handlers of one worker's health, metrics, timeline and fault admin routes."""

    def __init__(self, api: WorkerAPI) -> None:
        self._api = api

    def transport_stats(self) -> TransportStats:
        """The KV traffic figures the worker keeps (shared by its inbox and outbox)."""
        api = self._api
        if api.outbox is not None:
            return api.outbox.stats
        if api.inbox is not None:
            return api.inbox.stats
        return TransportStats()

    def _kv_endpoints(self) -> list[KVEndpoint]:
        api = self._api
        if api.inbox is not None:
            return api.inbox.endpoints
        # A prefill-only worker listens on nothing: it lists what it can send over.
        return [KVEndpoint(transport=t, address="") for t in api.local_transports]

    async def health(self, request: web.Request) -> web.Response:
        """GET /health -> WorkerHealth."""
        api = self._api
        arrived_ns = time.monotonic_ns()
        stats = await api.engine.stats()
        info = api.info
        body = WorkerHealth(
            worker_id=api.worker_id,
            instance_id=api.instance_id,
            draining=api.draining,
            role=api.config.role,  # type: ignore[arg-type]  # validated by WorkerConfig
            pid=os.getpid(),
            fingerprint=info.fingerprint,
            fingerprint_digest=info.fingerprint_digest,
            transfer_address=api.inbox.address if api.inbox is not None else None,
            max_model_len=info.max_model_len,
            block_size=info.block_size,
            num_blocks=stats.num_blocks,
            num_free_blocks=stats.num_free_blocks,
            num_pinned_blocks=stats.num_held_blocks,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_active_leases=api.leases.num_active,
            kv_endpoints=self._kv_endpoints(),
            problems=self.transport_stats().problems(),
            request_monotonic_ns=arrived_ns,
            monotonic_ns=time.monotonic_ns(),
            wall_time_s=time.time(),
            steps=step_totals_model(stats.steps),
        )
        if api.draining:
            api.drain_seen.set()  # a router (or a probe) has been told
        return _json(body)

    async def metrics(self, request: web.Request) -> web.Response:
        """GET /metrics: Prometheus text."""
        api = self._api
        stats = await api.engine.stats()
        inbox, outbox = api.inbox, api.outbox
        receiver = inbox.receiver if inbox is not None else None
        counters = WorkerCounters(
            transfers_sent=outbox.num_sent if outbox else 0,
            transfers_send_failed=outbox.num_failed if outbox else 0,
            transfers_received=receiver.num_verified if receiver else 0,
            transfer_attempts_refused=receiver.num_failed_attempts if receiver else 0,
            reservations_cancelled=inbox.num_cancelled if inbox else 0,
            lease_expiries=api.leases.num_expired_total,
            kv_send_retries=outbox.num_send_retries if outbox else 0,
            refusals_by_reason=dict(receiver.failed_attempts_by_reason) if receiver else {},
            lease_expiries_by_kind=dict(api.leases.expired_by_kind),
            num_reserved_blocks=inbox.num_reserved_blocks if inbox else 0,
        )
        sends = outbox.sends if outbox else None
        text = render(api.worker_id, stats, api.leases.num_active, counters, sends)
        text += render_reuse(api.worker_id, stats)
        text += render_steps(api.worker_id, stats.steps)
        text += render_fail_closed(
            api.worker_id,
            FailClosedCounters(
                canary=dict(api.canary_counts),
                fenced_writers=receiver.num_fenced_writers if receiver else 0,
                auth_refusals=api.verifier.num_refused if api.verifier else 0,
                admission_refusals=api.num_admission_refusals,
            ),
        )
        text += render_text(self.transport_stats().render(api.worker_id))
        if api.checkpoints is not None:
            text += api.checkpoints.render(api.worker_id)
        if api.cache_source is not None:
            text += api.cache_source.render(api.worker_id)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def debug_request(self, request: web.Request) -> web.Response:
        """GET /debug/requests/{id} -> WorkerEvents (suffixed ids `.rN`, `.mN` included)."""
        api = self._api
        arrived_ns = time.monotonic_ns()
        events = api.events.events_for(request.match_info["request_id"])
        return _json(
            WorkerEvents(
                worker_id=api.worker_id,
                role=api.config.role,  # type: ignore[arg-type]  # validated by WorkerConfig
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
        faults = self._api.faults
        assert faults is not None  # built whenever the admin routes exist
        return FaultState(
            rules=[rule.spec() for rule in faults.rules],
            seed=faults.seed,
            injected=[
                InjectedFaultModel(site=i.site.value, hit=i.hit, action=i.action.value)
                for i in faults.injected
            ],
            num_injected=faults.num_injected,
            hits={site.value: n for site, n in faults.hits.items()},
        )

    async def get_faults(self, request: web.Request) -> web.Response:
        """GET /admin/faults -> FaultState."""
        return _json(self._fault_state())

    async def set_faults(self, request: web.Request) -> web.Response:
        """POST /admin/faults FaultPlanBody -> FaultState; a bad rule is 400, naming it."""
        faults = self._api.faults
        assert faults is not None
        body = FaultPlanBody.model_validate_json(await request.read())
        faults.reset(parse_rules(body.rules), body.seed)
        return _json(self._fault_state())

    async def clear_faults(self, request: web.Request) -> web.Response:
        """DELETE /admin/faults -> FaultState of the empty plan."""
        faults = self._api.faults
        assert faults is not None
        faults.reset()
        return _json(self._fault_state())
