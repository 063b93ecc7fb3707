"""The metrics of decode checkpoints (`pdserve/checkpoint/`, `worker/checkpoint_*.py`) and of a
worker's prefix cache as a resume's source (`worker/checkpoint/prefix_source.py`): declared here, kept in
`metric_names.ALL` with every other metric (same naming rules, same dashboard check).
"""

from __future__ import annotations

from pdserve.observability.metric_spec import WORKER_LABELS as _W
from pdserve.observability.metric_spec import spec as _spec

# ---- worker: decode checkpoints (`pdserve/checkpoint/`) ---------------------------------------
WORKER_CHECKPOINT_RESUMES = _spec(
    "pdserve_worker_checkpoint_resumes_total",
    "counter",
    "Resumed requests by how their KV came back: checkpoint (pulled from the holder),"
    " peer_cache (pulled from another worker's prefix cache), local (this worker's prefix"
    " cache) or recompute, and why",
    *_W,
    "path",
    "reason",
)
WORKER_CHECKPOINT_RECOMPUTED_TOKENS = _spec(
    "pdserve_worker_checkpoint_recomputed_tokens_total",
    "counter",
    "Tokens (prompt + output already sent) that resumed requests recomputed",
    *_W,
)
WORKER_CHECKPOINT_RESUMED_TOKENS = _spec(
    "pdserve_worker_checkpoint_resumed_tokens_total",
    "counter",
    "Tokens (prompt + output already sent) that resumed requests had to restore",
    *_W,
)
WORKER_CHECKPOINT_PULLED_BYTES = _spec(
    "pdserve_worker_checkpoint_pulled_bytes_total",
    "counter",
    "KV bytes pulled from checkpoint holders by resumed requests",
    *_W,
)
WORKER_CHECKPOINT_PUT_BLOCKS = _spec(
    "pdserve_worker_checkpoint_put_blocks_total",
    "counter",
    "KV blocks this worker replicated to checkpoint holders",
    *_W,
)
WORKER_CHECKPOINT_PUT_BYTES = _spec(
    "pdserve_worker_checkpoint_put_bytes_total",
    "counter",
    "KV bytes this worker replicated to checkpoint holders",
    *_W,
)
WORKER_CHECKPOINT_PUT_TRANSPORT_BYTES = _spec(
    "pdserve_worker_checkpoint_put_transport_bytes_total",
    "counter",
    "KV bytes replicated to checkpoint holders, by the transport that carried them",
    *_W,
    "transport",
)
WORKER_CHECKPOINT_PUTS = _spec(
    "pdserve_worker_checkpoint_puts_total",
    "counter",
    "Checkpoint puts this worker sent, by how: over a replication link or a transfer session",
    *_W,
    "path",
)
WORKER_CHECKPOINT_LINK_PUTS_RECEIVED = _spec(
    "pdserve_worker_checkpoint_link_puts_received_total",
    "counter",
    "Checkpoint puts received over replication links as a holder, by result (held, or why refused)",
    *_W,
    "result",
)
WORKER_CHECKPOINT_STREAM_FAILURES = _spec(
    "pdserve_worker_checkpoint_stream_failures_total",
    "counter",
    "Checkpoint streams stopped because their holder failed (the request went on), by error",
    *_W,
    "error",
)
WORKER_CHECKPOINT_HELD_BLOCKS = _spec(
    "pdserve_worker_checkpoint_held_blocks",
    "gauge",
    "KV blocks this worker holds as a checkpoint holder (host memory)",
    *_W,
)
WORKER_CHECKPOINT_HELD_BYTES = _spec(
    "pdserve_worker_checkpoint_held_bytes",
    "gauge",
    "Host-memory bytes this worker holds or has reserved for checkpoints",
    *_W,
)
WORKER_CHECKPOINT_OWNERS = _spec(
    "pdserve_worker_checkpoint_owners",
    "gauge",
    "Requests holding checkpoints on this worker (each under a lease)",
    *_W,
)
WORKER_CHECKPOINT_REFUSALS = _spec(
    "pdserve_worker_checkpoint_refusals_total",
    "counter",
    "Checkpoint puts and reads this holder refused, by reason (full, version, fingerprint,"
    " checksum, chain, missing)",
    *_W,
    "reason",
)
WORKER_CHECKPOINT_CANARY = _spec(
    "pdserve_worker_checkpoint_canary_total",
    "counter",
    "Value checks of pulled checkpoints by result (exact, tolerance, mismatch, missing)",
    *_W,
    "result",
)

# ---- worker: its prefix cache as a resume's source (`worker/checkpoint/prefix_source.py`) -------------
WORKER_CACHE_SOURCE_LOOKUPS = _spec(
    "pdserve_worker_cache_source_lookups_total",
    "counter",
    "Resuming peers' lookups of their KV in this worker's prefix cache",
    *_W,
)
WORKER_CACHE_SOURCE_SENT_BLOCKS = _spec(
    "pdserve_worker_cache_source_sent_blocks_total",
    "counter",
    "Prefix-cache blocks this worker sent to resuming peers",
    *_W,
)
WORKER_CACHE_SOURCE_SENT_BYTES = _spec(
    "pdserve_worker_cache_source_sent_bytes_total",
    "counter",
    "Prefix-cache KV bytes this worker sent to resuming peers",
    *_W,
)
WORKER_CACHE_SOURCE_REFUSALS = _spec(
    "pdserve_worker_cache_source_refusals_total",
    "counter",
    "Prefix-cache sends refused (fingerprint, version, blocks evicted since the lookup), by reason",
    *_W,
    "reason",
)
WORKER_CACHE_SOURCE_SEND_FAILURES = _spec(
    "pdserve_worker_cache_source_send_failures_total",
    "counter",
    "Prefix-cache sends to resuming peers that failed in transfer, by error",
    *_W,
    "error",
)
WORKER_CHECKPOINT_LEASE_EXPIRIES = _spec(
    "pdserve_worker_checkpoint_lease_expiries_total",
    "counter",
    "Checkpoint owners released because their writer stopped renewing",
    *_W,
)
