"""The router's Prometheus metrics: requests, TTFT, KV handoffs, the breaker, handoff spikes.

Kept in-process with no client library: a counter map and one fixed-bucket histogram, rendered
in the Prometheus text exposition format (version 0.0.4). Not thread-safe; the router runs on
one event loop.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from pdserve.router.breaker import BreakerState, CircuitBreaker

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds; upper bounds of the TTFT histogram buckets (+Inf is implicit).
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Gauge values of pdserve_router_breaker_state.
BREAKER_STATE_VALUES = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


@dataclass(slots=True)
class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    num: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        """Record one value."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.num += 1

    def render(self, name: str) -> list[str]:
        """The `_bucket`, `_sum` and `_count` lines."""
        lines, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{le="{le}"}} {running}')
        lines += [f"{name}_sum {self.total!r}", f"{name}_count {self.num}"]
        return lines


@dataclass(slots=True)
class RouterMetrics:
    """Everything /metrics exposes."""

    requests: Counter[tuple[str, str]] = field(default_factory=Counter)
    ttft_s: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    # Handoff outcomes ("ok" / "failed"), counted as the disaggregated flow reports them.
    kv_handoffs: Counter[str] = field(default_factory=Counter)
    breaker: CircuitBreaker | None = None
    # Spikes per phase, owned by the spike detector (shared, not copied).
    handoff_spikes: Counter[str] = field(default_factory=Counter)

    def count_request(self, mode: str, status: str) -> None:
        """One finished request: status is "ok", "client_error", "no_capacity" or "error"."""
        self.requests[(mode, status)] += 1

    def render(self) -> str:
        """Prometheus text."""
        lines = [
            "# HELP pdserve_router_requests_total Requests finished, by mode and status.",
            "# TYPE pdserve_router_requests_total counter",
        ]
        for (mode, status), n in sorted(self.requests.items()):
            lines.append(f'pdserve_router_requests_total{{mode="{mode}",status="{status}"}} {n}')
        lines += [
            "# HELP pdserve_router_ttft_seconds Time from request received to first token.",
            "# TYPE pdserve_router_ttft_seconds histogram",
            *self.ttft_s.render("pdserve_router_ttft_seconds"),
            "# HELP pdserve_router_kv_handoffs_total KV handoffs, by outcome.",
            "# TYPE pdserve_router_kv_handoffs_total counter",
            *(
                f'pdserve_router_kv_handoffs_total{{outcome="{k}"}} {n}'
                for k, n in sorted(self.kv_handoffs.items())
            ),
            "# HELP pdserve_router_handoff_spikes_total Handoff phases far over their baseline.",
            "# TYPE pdserve_router_handoff_spikes_total counter",
            *(
                f'pdserve_router_handoff_spikes_total{{phase="{k}"}} {n}'
                for k, n in sorted(self.handoff_spikes.items())
            ),
        ]
        if self.breaker is not None:
            lines += [
                "# HELP pdserve_router_breaker_state KV-path breaker: 0 closed, 1 half-open, 2 open.",
                "# TYPE pdserve_router_breaker_state gauge",
                f"pdserve_router_breaker_state {BREAKER_STATE_VALUES[self.breaker.state]}",
                "# HELP pdserve_router_breaker_transitions_total Breaker state changes.",
                "# TYPE pdserve_router_breaker_transitions_total counter",
                *(
                    f'pdserve_router_breaker_transitions_total{{from="{a}",to="{b}"}} {n}'
                    for (a, b), n in sorted(self.breaker.counts.items())
                ),
            ]
        return "\n".join(lines) + "\n"
