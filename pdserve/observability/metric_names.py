"""Every Prometheus metric pdserve exports, defined once: name (with its unit), kind, help,
labels.

The router (`pdserve.router.metrics`) and the workers (`pdserve.worker.metrics`) render only
metrics declared here, and the Grafana dashboard (`deploy/grafana/pdserve.json`) is checked
against this list by a unit test, so a renamed metric cannot silently break a panel.

Naming: `pdserve_<process>_<what>_<unit>`; durations in `_seconds`, sizes in `_bytes`,
throughput in `_gigabytes_per_second` (10^9 bytes/s, the figure operators quote for links),
counters end in `_total`. A histogram's series are the name plus `_bucket`, `_sum`, `_count`.

Decode checkpoints declare theirs in `checkpoint_metric_names` (this file would pass 500
lines); `ALL`, `NAMES` and `SERIES` below cover both modules.
"""

from __future__ import annotations

from pdserve.observability import checkpoint_metric_names
from pdserve.observability.metric_spec import WORKER_LABELS, MetricSpec
from pdserve.observability.metric_spec import spec as _spec

# ---- router: per-request latencies (one sample per request unless said otherwise) ----------
ROUTER_REQUESTS = _spec(
    "pdserve_router_requests_total", "counter", "Requests finished, by mode and status.",
    "mode", "status",
)  # fmt: skip
ROUTER_TTFT = _spec(
    "pdserve_router_ttft_seconds", "histogram", "Time from request received to first token."
)
ROUTER_TPOT = _spec(
    "pdserve_router_tpot_seconds",
    "histogram",
    "Mean time per output token after the first, per request.",
)
ROUTER_ITL = _spec(
    "pdserve_router_itl_seconds",
    "histogram",
    "Inter-token latency at the router, one sample per token after the first.",
)
ROUTER_E2E = _spec(
    "pdserve_router_e2e_seconds", "histogram", "Time from request received to finished."
)
ROUTER_QUEUE = _spec(
    "pdserve_router_queue_seconds",
    "histogram",
    "Disaggregated: received to decode slot reserved (includes waiting for capacity).",
)
ROUTER_PREFILL = _spec(
    "pdserve_router_prefill_seconds", "histogram", "Prefill call to first token (PREFILLING to PREFILLED)."
)  # fmt: skip
ROUTER_TRANSFER = _spec(
    "pdserve_router_transfer_seconds",
    "histogram",
    "Decode asked to stream to verified KV accepted (TRANSFERRING to COMMITTED).",
)
ROUTER_HANDOFF_GAP = _spec(
    "pdserve_router_handoff_gap_seconds",
    "histogram",
    "Prefill done (first token) to the first decode-side token (PREFILLED to DECODING).",
)
# ---- router: failure handling ----------------------------------------------------------------
ROUTER_RETRIES = _spec(
    "pdserve_router_retries_total", "counter", "Recovery steps taken (RETRYING), by reason.",
    "reason",
)  # fmt: skip
ROUTER_FALLBACKS = _spec(
    "pdserve_router_fallbacks_total",
    "counter",
    "Requests served without a KV handoff although disaggregated was wanted, by reason.",
    "reason",
)
ROUTER_MIGRATIONS = _spec(
    "pdserve_router_migrations_total", "counter", "Decode streams moved to another worker."
)
ROUTER_KV_HANDOFFS = _spec(
    "pdserve_router_kv_handoffs_total",
    "counter",
    "KV handoffs, by outcome: ok, failed, slow (committed far below the transport rate).",
    "outcome",
)
ROUTER_HANDOFF_SPIKES = _spec(
    "pdserve_router_handoff_spikes_total",
    "counter",
    "Handoff phases far over their baseline.",
    "phase",
)
ROUTER_BREAKER_STATE = _spec(
    "pdserve_router_breaker_state", "gauge", "KV-path breaker: 0 closed, 1 half-open, 2 open."
)
ROUTER_BREAKER_TRANSITIONS = _spec(
    "pdserve_router_breaker_transitions_total", "counter", "Breaker state changes.", "from", "to"
)
# ---- router: prefill-decode interference and SLOs (`router/mode/interference.py`) ------------------
ROUTER_DECODE_TPOT = _spec(
    "pdserve_router_decode_tpot_seconds",
    "histogram",
    "Decode time per output token at the router, one sample per decode token, by whether"
    " prefill tokens shared the engine step that produced it (with / without).",
    "prefill",
)
ROUTER_DECODE_STEP = _spec(
    "pdserve_router_decode_step_seconds",
    "histogram",
    "Engine step time of each decode token as its worker reported it, by whether prefill"
    " tokens shared that step (with / without).",
    "prefill",
)
ROUTER_SLO_REQUESTS = _spec(
    "pdserve_router_slo_requests_total",
    "counter",
    "Requests whose flow ended, by outcome against the TTFT and TPOT SLOs (met, missed_ttft,"
    " missed_tpot, missed_both, failed).",
    "outcome",
)
ROUTER_SLO_ATTAINMENT = _spec(
    "pdserve_router_slo_attainment",
    "gauge",
    "Fraction of requests ended in the live window that met the SLO (ttft, tpot, both).",
    "slo",
)
ROUTER_SLO_TARGET = _spec(
    "pdserve_router_slo_target_seconds", "gauge", "The configured SLOs (ttft, tpot).", "slo"
)
# ---- router: automatic mode (`--mode auto`, `router/mode/auto_mode.py`) ----------------------------
ROUTER_AUTO_DECISIONS = _spec(
    "pdserve_router_auto_decisions_total",
    "counter",
    "Decisions of the automatic mode that changed mode or ratio, by action and reason.",
    "action",
    "reason",
)
ROUTER_AUTO_WORKERS = _spec(
    "pdserve_router_auto_workers",
    "gauge",
    "Workers the automatic mode assigns to each role now (prefill, decode; colocated: both).",
    "role",
)
ROUTER_AUTO_SPLIT = _spec(
    "pdserve_router_auto_split", "gauge", "1 while the automatic mode runs split, 0 colocated."
)
# ---- router: its view of each worker (from the last /health poll) -----------------------------
ROUTER_WORKER_UP = _spec(
    "pdserve_router_worker_up", "gauge", "1 if the worker's last health poll succeeded.",
    "worker", "role",
)  # fmt: skip
ROUTER_WORKER_BLOCKS_FREE = _spec(
    "pdserve_router_worker_blocks_free", "gauge", "Free KV blocks of the worker.", "worker", "role"
)
ROUTER_WORKER_BLOCKS_PINNED = _spec(
    "pdserve_router_worker_blocks_pinned",
    "gauge",
    "KV blocks the worker holds for another party.",
    "worker",
    "role",
)
ROUTER_WORKER_REQUESTS_RUNNING = _spec(
    "pdserve_router_worker_requests_running", "gauge", "Requests in the worker's running batch.",
    "worker", "role",
)  # fmt: skip
ROUTER_WORKER_REQUESTS_WAITING = _spec(
    "pdserve_router_worker_requests_waiting", "gauge", "Requests queued on the worker.",
    "worker", "role",
)  # fmt: skip
ROUTER_WORKER_INFLIGHT = _spec(
    "pdserve_router_worker_inflight_requests", "gauge", "Router calls in flight to the worker.",
    "worker", "role",
)  # fmt: skip
ROUTER_WORKER_CLOCK_OFFSET = _spec(
    "pdserve_router_worker_clock_offset_seconds",
    "gauge",
    "Estimated worker monotonic clock minus the router's (NTP-style, best round trip).",
    "worker",
    "role",
)
ROUTER_WORKER_INFO = _spec(
    "pdserve_router_worker_info",
    "gauge",
    "1 per worker: its model revision (fingerprint digest), process instance and drain state.",
    "worker",
    "role",
    "revision",
    "instance",
    "draining",
)

ROUTER_KV_PAIR_GBPS = _spec(
    "pdserve_router_kv_pair_gigabytes_per_second", "gauge",
    "The probe's KV rate per prefill/decode pair and transport (taken when the pair formed).",
    "prefill", "decode", "transport", "verdict",
)  # fmt: skip
ROUTER_KV_PAIR_PROBES = _spec(
    "pdserve_router_kv_pair_probes_total", "counter",
    "Pair probes, by verdict: ok, slow (far below the transport's rate), failed.", "verdict",
)  # fmt: skip

# ---- worker ------------------------------------------------------------------------------------
_W = WORKER_LABELS
WORKER_BLOCKS_TOTAL = _spec("pdserve_worker_blocks_total", "gauge", "KV blocks in the cache", *_W)
WORKER_BLOCKS_FREE = _spec(
    "pdserve_worker_blocks_free", "gauge", "KV blocks free (cached-but-unused included)", *_W
)
WORKER_BLOCKS_PINNED = _spec(
    "pdserve_worker_blocks_pinned", "gauge", "KV blocks held for another party", *_W
)
WORKER_BLOCKS_RESERVED = _spec(
    "pdserve_worker_blocks_reserved",
    "gauge",
    "KV blocks allocated to decode reservations awaiting their transfer",
    *_W,
)
WORKER_REQUESTS_RUNNING = _spec(
    "pdserve_worker_requests_running", "gauge", "requests in the running batch", *_W
)
WORKER_REQUESTS_WAITING = _spec(
    "pdserve_worker_requests_waiting", "gauge", "requests queued for prefill", *_W
)
WORKER_REQUESTS_REMOTE_WAITING = _spec(
    "pdserve_worker_requests_remote_waiting", "gauge", "reservations awaiting remote KV", *_W
)
WORKER_LEASES_ACTIVE = _spec(
    "pdserve_worker_leases_active", "gauge", "leases granted and not ended", *_W
)
WORKER_TRANSFERS_SENT = _spec(
    "pdserve_worker_transfers_sent_total", "counter", "KV transfers acknowledged", *_W
)
WORKER_TRANSFERS_SEND_FAILED = _spec(
    "pdserve_worker_transfers_send_failed_total", "counter", "KV sends that failed", *_W
)
WORKER_TRANSFERS_RECEIVED = _spec(
    "pdserve_worker_transfers_received_total", "counter", "KV transfers verified", *_W
)
WORKER_TRANSFER_ATTEMPTS_REFUSED = _spec(
    "pdserve_worker_transfer_attempts_refused_total",
    "counter",
    "incoming transfer attempts refused",
    *_W,
)
WORKER_TRANSFER_REFUSALS = _spec(
    "pdserve_worker_transfer_refusals_total",
    "counter",
    "incoming transfer attempts refused, by reason (the error class)",
    *_W,
    "reason",
)
WORKER_SKEW_REFUSALS = _spec(
    "pdserve_worker_skew_refusals_total",
    "counter",
    "transfers refused at the handshake because the builds differ, by reason",
    *_W,
    "reason",
)
WORKER_RESERVATIONS_CANCELLED = _spec(
    "pdserve_worker_reservations_cancelled_total",
    "counter",
    "reservations freed without decoding",
    *_W,
)
WORKER_LEASE_EXPIRIES = _spec(
    "pdserve_worker_lease_expiries_total", "counter", "leases ended by expiry", *_W
)
WORKER_LEASE_EXPIRIES_BY_REASON = _spec(
    "pdserve_worker_lease_expiries_by_reason_total",
    "counter",
    "leases ended by expiry, by what the lease held (prefill, reservation)",
    *_W,
    "reason",
)
WORKER_KV_SEND_RETRIES = _spec(
    "pdserve_worker_kv_send_retries_total",
    "counter",
    "KV send attempts after the first (resends from the held snapshot)",
    *_W,
)
WORKER_KV_SEND_SECONDS = _spec(
    "pdserve_worker_kv_send_seconds",
    "histogram",
    "acknowledged KV sends: first connect to final ack, retries included",
    *_W,
)
WORKER_KV_SEND_BYTES = _spec(
    "pdserve_worker_kv_send_bytes", "histogram", "KV bytes of acknowledged sends", *_W
)
WORKER_KV_SEND_THROUGHPUT = _spec(
    "pdserve_worker_kv_send_gigabytes_per_second",
    "histogram",
    "KV bytes / send time of acknowledged sends, in 10^9 bytes per second",
    *_W,
)

# KV reuse (prefix cache, affinity routing): rendered by `pdserve.worker.reuse_metrics`.
WORKER_PREFILL_TOKENS = _spec(
    "pdserve_worker_prefill_tokens_total", "counter", "tokens admitted for local prefill", *_W
)
WORKER_PREFILL_CACHED_TOKENS = _spec(
    "pdserve_worker_prefill_cached_tokens_total",
    "counter",
    "tokens of local prefills supplied by the prefix cache",
    *_W,
)
WORKER_KV_RECEIVED_BLOCKS = _spec(
    "pdserve_worker_kv_received_blocks_total",
    "counter",
    "KV blocks received by verified transfer",
    *_W,
)
WORKER_KV_RECEIVED_BYTES = _spec(
    "pdserve_worker_kv_received_bytes_total", "counter", "KV bytes received by verified transfer",
    *_W,
)  # fmt: skip
WORKER_KV_RECEIVED_CACHED_TOKENS = _spec(
    "pdserve_worker_kv_received_cached_tokens_total",
    "counter",
    "prompt tokens of remote-KV requests already cached here (not transferred)",
    *_W,
)

# KV transports (which one each pair really uses; no silent downgrade): `worker.transport_stats`.
WORKER_KV_TRANSPORT_BYTES = _spec(
    "pdserve_worker_kv_transport_bytes_total",
    "counter",
    "KV bytes of completed transfers, by transport and direction (sent, received)",
    *_W,
    "transport",
    "direction",
)
WORKER_KV_TRANSPORT_HANDOFFS = _spec(
    "pdserve_worker_kv_transport_handoffs_total",
    "counter",
    "completed KV transfers, by transport and direction (sent, received)",
    *_W,
    "transport",
    "direction",
)
WORKER_KV_TRANSPORT_DOWNGRADES = _spec(
    "pdserve_worker_kv_transport_downgrades_total",
    "counter",
    "sends over a worse transport than the decode side offered, by what was given up and why",
    *_W,
    "wanted",
    "used",
    "reason",
)
WORKER_KV_SLOW_TRANSFERS = _spec(
    "pdserve_worker_kv_slow_transfers_total",
    "counter",
    "completed transfers far below their transport's expected rate",
    *_W,
    "transport",
)
WORKER_KV_PAIR_THROUGHPUT = _spec(
    "pdserve_worker_kv_pair_gigabytes_per_second",
    "gauge",
    "achieved KV rate per peer and transport (moving average over completed transfers)",
    *_W,
    "transport",
    "peer",
)
# Fail-closed checks on the worker.
WORKER_KV_CANARY = _spec(
    "pdserve_worker_kv_canary_total",
    "counter",
    "received KV checked by value before the first token, by result (exact, tolerance,"
    " mismatch, missing)",
    *_W,
    "result",
)
WORKER_KV_FENCED_WRITERS = _spec(
    "pdserve_worker_kv_fenced_writers_total",
    "counter",
    "KV connections cancelled (and waited for) before their blocks were freed or re-sent",
    *_W,
)
WORKER_AUTH_REFUSALS = _spec(
    "pdserve_worker_auth_refusals_total",
    "counter",
    "control calls refused for their cluster credential (missing, forged, stale, replayed)",
    *_W,
)
WORKER_ADMISSION_REFUSALS = _spec(
    "pdserve_worker_admission_refusals_total",
    "counter",
    "requests refused with 503 because the waiting queue was full",
    *_W,
)
# Engine steps (prefill-decode interference): rendered by `pdserve.worker.step_report`.
WORKER_STEPS = _spec(
    "pdserve_worker_steps_total",
    "counter",
    "engine steps, by what shared the batch: decode (decode only), prefill (prefill only),"
    " mixed (prefill tokens with decode tokens)",
    *_W,
    "batch",
)
WORKER_STEP_SECONDS = _spec(
    "pdserve_worker_step_seconds_total",
    "counter",
    "seconds spent in engine steps, by what shared the batch",
    *_W,
    "batch",
)
WORKER_DEVICE_MEMORY = _spec(
    "pdserve_worker_device_memory_bytes",
    "gauge",
    "On a GPU, torch's allocator: bytes of live tensors (allocated) and held (reserved)",
    *_W,
    "kind",
)
WORKER_KV_HOST_STAGED_BYTES = _spec(
    "pdserve_worker_kv_host_staged_bytes_total",
    "counter",
    "KV bytes copied through the host mirror (the GPU fallback path), device to mirror (out)"
    " or mirror to device (in)",
    *_W,
    "direction",
)
WORKER_PHASE_BUSY_SECONDS = _spec(
    "pdserve_worker_phase_busy_seconds_total",
    "counter",
    "engine seconds attributed to each phase (of a mixed step, decode gets what a decode-only"
    " step costs, prefill the rest)",
    *_W,
    "phase",
)

ALL: tuple[MetricSpec, ...] = tuple(
    v
    for v in [*globals().values(), *vars(checkpoint_metric_names).values()]
    if isinstance(v, MetricSpec)
)
NAMES: frozenset[str] = frozenset(spec.name for spec in ALL)
# Series names a query may use: a histogram's three series, everything else its own name.
SERIES: frozenset[str] = frozenset(
    name
    for spec in ALL
    for name in (
        (f"{spec.name}_bucket", f"{spec.name}_sum", f"{spec.name}_count")
        if spec.kind == "histogram"
        else (spec.name,)
    )
)
