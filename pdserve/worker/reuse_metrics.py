"""KV reuse counters as Prometheus text: what prefix caching and affinity routing saved.

Appended to the worker's /metrics. Every value is a total the engine's scheduler keeps
(`EngineStats`), read at scrape time:

- `pdserve_worker_prefill_tokens_total`: prompt (and resumed output) tokens this worker
  admitted for local compute: the prefill work it actually did;
- `pdserve_worker_prefill_cached_tokens_total`: tokens those requests found in the prefix cache;
- `pdserve_worker_kv_received_blocks_total` / `_bytes_total`: KV blocks (and their bytes, all
  layers) that arrived by verified transfer for remote-KV requests: exactly the blocks after the
  decode side's cached prefix, since the sender skips those;
- `pdserve_worker_kv_received_cached_tokens_total`: prompt tokens of remote-KV requests that
  were already cached here and so never travelled.

It formats numbers; it does not know where they come from beyond `EngineStats`.
"""

from __future__ import annotations

from pdserve.engine.outputs import EngineStats
from pdserve.observability import metric_names as m
from pdserve.observability.exposition import render_text, render_values


def render_reuse(worker_id: str, stats: EngineStats) -> str:
    """Prometheus exposition lines (counters) for `stats`; names from `metric_names`."""
    lines = render_values(
        {"worker_id": worker_id},
        [
            (m.WORKER_PREFILL_TOKENS, stats.num_prefill_tokens_total),
            (m.WORKER_PREFILL_CACHED_TOKENS, stats.num_prefill_cached_tokens_total),
            (m.WORKER_KV_RECEIVED_BLOCKS, stats.num_remote_kv_blocks_total),
            (m.WORKER_KV_RECEIVED_BYTES, stats.num_remote_kv_blocks_total * stats.kv_block_bytes),
            (m.WORKER_KV_RECEIVED_CACHED_TOKENS, stats.num_remote_cached_tokens_total),
        ],
    )
    return render_text(lines)
