"""The worker's Prometheus text: gauges read at scrape time, counters kept by their owners.

Gauges come from the engine's `EngineStats` and the lease table; counters are the totals the
outbox (sends), the receiver (verified commits, failed attempts) and the lease table (expiries)
already keep, so there is no second count to drift. Names are prefixed `pdserve_worker_` and
labelled with the worker id.

It knows how to format numbers; not where they come from.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.engine import EngineStats


@dataclass(frozen=True, slots=True)
class WorkerCounters:
    """Totals since start, read at scrape time."""

    transfers_sent: int = 0
    transfers_send_failed: int = 0
    transfers_received: int = 0
    transfer_attempts_refused: int = 0
    reservations_cancelled: int = 0
    lease_expiries: int = 0


def _line(name: str, kind: str, help_text: str, value: float, worker_id: str) -> str:
    metric = f"pdserve_worker_{name}"
    return (
        f"# HELP {metric} {help_text}\n# TYPE {metric} {kind}\n"
        f'{metric}{{worker_id="{worker_id}"}} {value}\n'
    )


def render(
    worker_id: str, stats: EngineStats, num_active_leases: int, counters: WorkerCounters
) -> str:
    """Prometheus exposition text (version 0.0.4)."""
    gauges = (
        ("blocks_total", "KV blocks in the cache", stats.num_blocks),
        ("blocks_free", "KV blocks free (cached-but-unused included)", stats.num_free_blocks),
        ("blocks_pinned", "KV blocks held for another party", stats.num_held_blocks),
        ("requests_running", "requests in the running batch", stats.num_running),
        ("requests_waiting", "requests queued for prefill", stats.num_waiting),
        ("requests_remote_waiting", "reservations awaiting remote KV", stats.num_remote_waiting),
        ("leases_active", "leases granted and not ended", num_active_leases),
    )
    totals = (
        ("transfers_sent_total", "KV transfers acknowledged", counters.transfers_sent),
        ("transfers_send_failed_total", "KV sends that failed", counters.transfers_send_failed),
        ("transfers_received_total", "KV transfers verified", counters.transfers_received),
        (
            "transfer_attempts_refused_total",
            "incoming transfer attempts refused",
            counters.transfer_attempts_refused,
        ),
        (
            "reservations_cancelled_total",
            "reservations freed without decoding",
            counters.reservations_cancelled,
        ),
        ("lease_expiries_total", "leases ended by expiry", counters.lease_expiries),
    )
    parts = [_line(n, "gauge", h, v, worker_id) for n, h, v in gauges]
    parts += [_line(n, "counter", h, v, worker_id) for n, h, v in totals]
    return "".join(parts)
