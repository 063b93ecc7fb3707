"""The router's Prometheus metrics: requests, latencies, KV handoffs, failure handling, the
breaker, and its view of each worker.

Every family is declared in `pdserve.observability.metric_names`; this module only keeps the
values. Per-request latencies and failure-handling counts are taken from the request's
timeline once its flow has ended (`observe_request`, fed by the dispatcher), the inter-token
latency as tokens arrive (`observe_itl`), so /metrics and /debug/requests/{id} agree exactly
for the same requests. Worker gauges are read from the pool at scrape time. Not thread-safe;
the router runs on one event loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric

from pdserve.observability import metric_names as m
from pdserve.observability.exposition import (
    Histogram,
    by_label,
    render_each_histogram,
    render_family,
    render_text,
)
from pdserve.observability.request_stats import RequestStats
from pdserve.router.mode.breaker import BreakerState, CircuitBreaker
from pdserve.router.workers.pair_probes import PairProbe
from pdserve.router.workers.pool import WorkerPool

__all__ = ["RouterMetrics", "WorkerGauges"]

# Gauge values of pdserve_router_breaker_state.
BREAKER_STATE_VALUES = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


@dataclass(frozen=True, slots=True)
class WorkerGauges:
    """One worker as the router last saw it (None: never answered a health poll)."""

    worker: str  # its base URL: unique, unlike a configured worker id
    role: str
    up: bool
    num_free_blocks: int | None
    num_pinned_blocks: int | None
    num_running: int | None
    num_waiting: int | None
    num_inflight: int
    clock_offset_s: float | None
    # The model revision (fingerprint digest), this life of the process, and whether it drains.
    revision: str | None = None
    instance: str | None = None
    draining: bool = False


@dataclass(slots=True)
class RouterMetrics:
    """Everything /metrics exposes."""

    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    ttft_s: Histogram = field(default_factory=Histogram)
    tpot_s: Histogram = field(default_factory=Histogram)
    itl_s: Histogram = field(default_factory=Histogram)
    e2e_s: Histogram = field(default_factory=Histogram)
    queue_s: Histogram = field(default_factory=Histogram)
    prefill_s: Histogram = field(default_factory=Histogram)
    transfer_s: Histogram = field(default_factory=Histogram)
    handoff_gap_s: Histogram = field(default_factory=Histogram)
    retries: Counter[str] = field(default_factory=Counter)
    fallbacks: Counter[str] = field(default_factory=Counter)
    num_migrations: int = 0
    # Handoff outcomes ("ok" / "failed"), counted as the disaggregated flow reports them.
    kv_handoffs: Counter[str] = field(default_factory=Counter)
    # Pair probes by verdict, and the current pairs' last probes (`pair_probes.py`).
    kv_pair_probes: Counter[str] = field(default_factory=Counter)
    kv_pairs: Callable[[], Sequence[PairProbe]] | None = None
    breaker: CircuitBreaker | None = None
    # Spikes per phase, owned by the spike detector (shared, not copied).
    handoff_spikes: Counter[str] = field(default_factory=Counter)
    # The pool's workers, read at scrape time (None: no worker gauges).
    workers: Callable[[], Sequence[WorkerGauges]] | None = None
    # Families kept elsewhere (the live monitor, the automatic mode), rendered after these.
    extra: list[Callable[[], list[Metric]]] = field(default_factory=list)

    def count_request(self, mode: str, status: str) -> None:
        """One finished request: status is "ok", "client_error", "no_capacity" or "error"."""
        self.requests[(mode, status)] += 1

    def observe_itl(self, seconds_per_token: float, num_tokens: int) -> None:
        """`num_tokens` tokens arrived together, each `seconds_per_token` after the last."""
        for _ in range(num_tokens):
            self.itl_s.observe(seconds_per_token)

    def observe_request(self, stats: RequestStats) -> None:
        """A request whose flow ended: its latencies and failure-handling steps."""
        for hist, value in (
            (self.ttft_s, stats.ttft_s),
            (self.e2e_s, stats.e2e_s),
            (self.tpot_s, stats.tpot_s),
            (self.queue_s, stats.queue_s),
            (self.prefill_s, stats.phases.get("prefill")),
            (self.transfer_s, stats.phases.get("transfer")),
            (self.handoff_gap_s, stats.phases.get("handoff")),
        ):
            if value is not None:
                hist.observe(value)
        self.retries.update(stats.retries)
        self.fallbacks.update(stats.fallbacks)
        self.num_migrations += stats.num_migrations

    def render(self) -> str:
        """Prometheus text."""
        lines = render_family(
            m.ROUTER_REQUESTS,
            (
                ({"mode": mode, "status": status}, n)
                for (mode, status), n in sorted(self.requests.items())
            ),
        )
        lines += render_each_histogram(
            {},
            [
                (m.ROUTER_TTFT, self.ttft_s),
                (m.ROUTER_TPOT, self.tpot_s),
                (m.ROUTER_ITL, self.itl_s),
                (m.ROUTER_E2E, self.e2e_s),
                (m.ROUTER_QUEUE, self.queue_s),
                (m.ROUTER_PREFILL, self.prefill_s),
                (m.ROUTER_TRANSFER, self.transfer_s),
                (m.ROUTER_HANDOFF_GAP, self.handoff_gap_s),
            ],
        )
        for spec, counts, label in (
            (m.ROUTER_RETRIES, self.retries, "reason"),
            (m.ROUTER_FALLBACKS, self.fallbacks, "reason"),
            (m.ROUTER_KV_HANDOFFS, self.kv_handoffs, "outcome"),
            (m.ROUTER_KV_PAIR_PROBES, self.kv_pair_probes, "verdict"),
            (m.ROUTER_HANDOFF_SPIKES, self.handoff_spikes, "phase"),
        ):
            lines += render_family(spec, by_label({}, label, counts))
        lines += render_family(m.ROUTER_MIGRATIONS, [({}, self.num_migrations)])
        if self.breaker is not None:
            lines += render_family(
                m.ROUTER_BREAKER_STATE, [({}, BREAKER_STATE_VALUES[self.breaker.state])]
            )
            lines += render_family(
                m.ROUTER_BREAKER_TRANSITIONS,
                (({"from": a, "to": b}, n) for (a, b), n in sorted(self.breaker.counts.items())),
            )
        if self.kv_pairs is not None:
            lines += render_family(
                m.ROUTER_KV_PAIR_GBPS,
                (
                    ({"prefill": p.prefill, "decode": p.decode, "transport": p.transport,
                      "verdict": p.verdict.value}, round(p.gbps, 4))
                    for p in self.kv_pairs()
                ),
            )  # fmt: skip
        if self.workers is not None:
            lines += _render_workers(self.workers())
        for render in self.extra:
            lines += render()
        return render_text(lines)


def _render_workers(workers: Sequence[WorkerGauges]) -> list[Metric]:
    info = [
        (
            {"worker": w.worker, "role": w.role, "revision": w.revision or "",
             "instance": w.instance or "", "draining": str(w.draining).lower()},
            1.0,
        )
        for w in workers
        if w.revision is not None
    ]  # fmt: skip
    lines: list[Metric] = render_family(m.ROUTER_WORKER_INFO, info)
    for spec, value in (
        (m.ROUTER_WORKER_UP, lambda w: float(w.up)),
        (m.ROUTER_WORKER_BLOCKS_FREE, lambda w: w.num_free_blocks),
        (m.ROUTER_WORKER_BLOCKS_PINNED, lambda w: w.num_pinned_blocks),
        (m.ROUTER_WORKER_REQUESTS_RUNNING, lambda w: w.num_running),
        (m.ROUTER_WORKER_REQUESTS_WAITING, lambda w: w.num_waiting),
        (m.ROUTER_WORKER_INFLIGHT, lambda w: w.num_inflight),
        (m.ROUTER_WORKER_CLOCK_OFFSET, lambda w: w.clock_offset_s),
    ):
        samples = [
            ({"worker": w.worker, "role": w.role}, v)
            for w in workers
            if (v := value(w)) is not None
        ]
        lines += render_family(spec, samples)
    return lines


def worker_gauges(pool: WorkerPool) -> list[WorkerGauges]:
    """The pool's workers as the router last saw them."""
    gauges = []
    for view in pool.snapshot():
        h = view.health
        clock = pool.clock(view.url)
        offset = None if clock is None else clock.offset_ns
        gauges.append(
            WorkerGauges(
                worker=view.url,
                role=h.role if h is not None else "unknown",
                up=view.healthy,
                num_free_blocks=h.num_free_blocks if h is not None else None,
                num_pinned_blocks=h.num_pinned_blocks if h is not None else None,
                num_running=h.num_running if h is not None else None,
                num_waiting=h.num_waiting if h is not None else None,
                num_inflight=view.num_inflight,
                clock_offset_s=None if offset is None else offset / 1e9,
                revision=h.fingerprint_digest if h is not None else None,
                instance=(h.instance_id or None) if h is not None else None,
                draining=h.draining if h is not None else False,
            )
        )
    return gauges
