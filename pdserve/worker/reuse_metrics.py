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

from pdserve.engine.engine import EngineStats


def render_reuse(worker_id: str, stats: EngineStats) -> str:
    """Prometheus exposition lines (counters) for `stats`."""
    families = (
        (
            "prefill_tokens_total",
            "tokens admitted for local prefill",
            stats.num_prefill_tokens_total,
        ),
        (
            "prefill_cached_tokens_total",
            "tokens of local prefills supplied by the prefix cache",
            stats.num_prefill_cached_tokens_total,
        ),
        (
            "kv_received_blocks_total",
            "KV blocks received by verified transfer",
            stats.num_remote_kv_blocks_total,
        ),
        (
            "kv_received_bytes_total",
            "KV bytes received by verified transfer",
            stats.num_remote_kv_blocks_total * stats.kv_block_bytes,
        ),
        (
            "kv_received_cached_tokens_total",
            "prompt tokens of remote-KV requests already cached here (not transferred)",
            stats.num_remote_cached_tokens_total,
        ),
    )
    lines: list[str] = []
    for name, help_text, value in families:
        metric = f"pdserve_worker_{name}"
        lines += [
            f"# HELP {metric} {help_text}",
            f"# TYPE {metric} counter",
            f'{metric}{{worker_id="{worker_id}"}} {value}',
        ]
    return "\n".join(lines) + "\n"
