"""The worker's Prometheus text: gauges read at scrape time, counters kept by their owners.

Gauges come from the engine's `EngineStats`, the lease table and the inbox; counters are the
totals the outbox (sends, resends, send histograms), the receiver (verified commits, refused
attempts by reason) and the lease keeper (expiries by kind) already keep, so there is no
second count to drift. Every family is declared in `pdserve.observability.metric_names` and
labelled with the worker id.

It knows how to format numbers; not where they come from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdserve.engine.outputs import EngineStats
from pdserve.observability import metric_names as m
from pdserve.observability.exposition import (
    BYTES_BUCKETS,
    GBPS_BUCKETS,
    Histogram,
    by_label,
    render_each_histogram,
    render_family,
    render_text,
    render_values,
)

# Refusal reasons (error classes) that mean the two builds differ: version skew between a
# prefill and a decode worker, refused at the handshake (DESIGN.md invariant 3).
SKEW_REASONS: Mapping[str, str] = {
    "FingerprintMismatch": "fingerprint",
    "UnsupportedVersion": "protocol_version",
}


@dataclass(slots=True)
class SendHistograms:
    """Acknowledged KV sends of one worker (the outbox observes them)."""

    seconds: Histogram = field(default_factory=Histogram)
    num_bytes: Histogram = field(default_factory=lambda: Histogram(BYTES_BUCKETS))
    gigabytes_per_second: Histogram = field(default_factory=lambda: Histogram(GBPS_BUCKETS))

    def observe(self, seconds: float, num_bytes: int) -> None:
        """One send: wall time from first connect to final ack, and the KV bytes it moved."""
        self.seconds.observe(seconds)
        self.num_bytes.observe(num_bytes)
        if seconds > 0:
            self.gigabytes_per_second.observe(num_bytes / seconds / 1e9)


@dataclass(frozen=True, slots=True)
class WorkerCounters:
    """Totals since start, read at scrape time."""

    transfers_sent: int = 0
    transfers_send_failed: int = 0
    transfers_received: int = 0
    transfer_attempts_refused: int = 0
    reservations_cancelled: int = 0
    lease_expiries: int = 0
    # Attempts after the first of every send (resends from the held snapshot).
    kv_send_retries: int = 0
    refusals_by_reason: Mapping[str, int] = field(default_factory=dict)
    lease_expiries_by_kind: Mapping[str, int] = field(default_factory=dict)
    # Blocks allocated to reservations still waiting for their KV.
    num_reserved_blocks: int = 0


def render(
    worker_id: str,
    stats: EngineStats,
    num_active_leases: int,
    counters: WorkerCounters,
    sends: SendHistograms | None = None,
) -> str:
    """Prometheus exposition text (version 0.0.4)."""
    w = {"worker_id": worker_id}
    lines = render_values(
        w,
        [
            (m.WORKER_BLOCKS_TOTAL, stats.num_blocks),
            (m.WORKER_BLOCKS_FREE, stats.num_free_blocks),
            (m.WORKER_BLOCKS_PINNED, stats.num_held_blocks),
            (m.WORKER_BLOCKS_RESERVED, counters.num_reserved_blocks),
            (m.WORKER_REQUESTS_RUNNING, stats.num_running),
            (m.WORKER_REQUESTS_WAITING, stats.num_waiting),
            (m.WORKER_REQUESTS_REMOTE_WAITING, stats.num_remote_waiting),
            (m.WORKER_LEASES_ACTIVE, num_active_leases),
            (m.WORKER_TRANSFERS_SENT, counters.transfers_sent),
            (m.WORKER_TRANSFERS_SEND_FAILED, counters.transfers_send_failed),
            (m.WORKER_TRANSFERS_RECEIVED, counters.transfers_received),
            (m.WORKER_TRANSFER_ATTEMPTS_REFUSED, counters.transfer_attempts_refused),
            (m.WORKER_RESERVATIONS_CANCELLED, counters.reservations_cancelled),
            (m.WORKER_LEASE_EXPIRIES, counters.lease_expiries),
            (m.WORKER_KV_SEND_RETRIES, counters.kv_send_retries),
        ],
    )
    refusals = counters.refusals_by_reason
    lines += render_family(m.WORKER_TRANSFER_REFUSALS, by_label(w, "reason", refusals))
    skew = {SKEW_REASONS[r]: n for r, n in refusals.items() if r in SKEW_REASONS}
    lines += render_family(m.WORKER_SKEW_REFUSALS, by_label(w, "reason", skew))
    lines += render_family(
        m.WORKER_LEASE_EXPIRIES_BY_REASON, by_label(w, "reason", counters.lease_expiries_by_kind)
    )
    lines += render_family(m.WORKER_DEVICE_MEMORY, by_label(w, "kind", stats.device_memory))
    lines += render_family(
        m.WORKER_KV_HOST_STAGED_BYTES, by_label(w, "direction", stats.host_staged_bytes)
    )
    if sends is not None:
        lines += render_each_histogram(
            w,
            [
                (m.WORKER_KV_SEND_SECONDS, sends.seconds),
                (m.WORKER_KV_SEND_BYTES, sends.num_bytes),
                (m.WORKER_KV_SEND_THROUGHPUT, sends.gigabytes_per_second),
            ],
        )
    return render_text(lines)


@dataclass(frozen=True, slots=True)
class FailClosedCounters:
    """Totals of the fail-closed checks (canary, fencing, credentials, admission)."""

    canary: Mapping[str, int] = field(default_factory=dict)
    fenced_writers: int = 0
    auth_refusals: int = 0
    admission_refusals: int = 0


def render_fail_closed(worker_id: str, counters: FailClosedCounters) -> str:
    """Prometheus lines of the fail-closed counters."""
    w = {"worker_id": worker_id}
    lines = render_family(m.WORKER_KV_CANARY, by_label(w, "result", counters.canary))
    lines += render_values(
        w,
        [
            (m.WORKER_KV_FENCED_WRITERS, counters.fenced_writers),
            (m.WORKER_AUTH_REFUSALS, counters.auth_refusals),
            (m.WORKER_ADMISSION_REFUSALS, counters.admission_refusals),
        ],
    )
    return render_text(lines)
