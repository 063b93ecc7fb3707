"""`pdserve chaos --checkpoint-costs`: what a decode worker's death mid-decode costs the client
with decode checkpoints on and off, at several context lengths.

For each context length and each mode, a fresh cluster (one prefill, two decode workers; the
router with `--checkpoint every-1` or `off`) serves one streamed, greedy completion whose
prompt has that many tokens, after two warm-up requests (one per decode worker) have opened
the KV connections, as in a cluster that has been serving. Once the client has `kill_after` tokens, the decode worker
streaming it is SIGKILLed; the router migrates the request to the other decode worker, which
pulls the checkpoint (on) or recomputes prompt + output (off). Then the same request runs
again fault-free on the survivor: the reference text. Measured, per run:

- `kill_to_next_token_s`: from the kill to the next token reaching the client;
- `recomputed_tokens`: tokens the survivor computed to resume (its prefill tokens minus those
  it found cached, from its /metrics, before and after);
- `pulled_bytes`: KV bytes it pulled from the checkpoint holder;
- `text_equal`: whether the client's tokens equal the fault-free run's.

The ratio of the two modes' recovery times is reported per context; the issue's targets (at
the longest context: recovery <= 1/4 of the recompute path, fewer recomputed tokens than one
block) are checked and reported, never assumed.

The default model is built here: the tiny model's width with room for 10k positions (random
weights; greedy output is deterministic, which is all this needs).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from pdlab.bench.kv_heavy_model import KVHeavyShape, build_kv_heavy_checkpoint
from pdlab.chaos.cluster import ChaosCluster, http_json
from pdlab.chaos.scenarios import WorkerSpec
from pdserve.advise.client import stream_completion
from pdserve.observability.exposition import parse as parse_exposition

log = logging.getLogger(__name__)

MODES = ("off", "every-1")
# The tiny model's width, long enough for 8k-token contexts: 8 KiB of KV per token.
LONG_CONTEXT_SHAPE = KVHeavyShape(
    num_layers=4,
    num_kv_heads=4,
    head_dim=64,
    hidden_size=256,
    intermediate_size=768,
    max_position_embeddings=10240,
)
_WORKERS = (
    WorkerSpec("prefill-0", "prefill"),
    WorkerSpec("decode-0", "decode"),
    WorkerSpec("decode-1", "decode"),
)


@dataclass(frozen=True, slots=True)
class CostConfig:
    """What the cost run measures."""

    contexts: tuple[int, ...] = (512, 2048, 8192)
    modes: tuple[str, ...] = MODES
    max_tokens: int = 64
    kill_after: int = 24
    model: str | None = None
    json_path: Path | None = None
    workdir: Path | None = None


@dataclass(slots=True)
class CostResult:
    """One (context, mode) run."""

    context_tokens: int
    mode: str
    kill_to_next_token_s: float | None = None
    recomputed_tokens: int | None = None
    pulled_bytes: int | None = None
    # How the survivor resumed ("checkpoint", "local", "recompute"; "" without checkpoints).
    resume_path: str = ""
    text_equal: bool = False
    # Tokens the client had when the kill came, and those the dead worker had sent (the
    # resume point: the first token after them is the first of the new worker).
    tokens_at_kill: int = 0
    tokens_before_resume: int = 0
    # The survivor's admission counters over the resume (prefill computed, prefix-cache hits).
    admitted_computed_tokens: int = 0
    admitted_cached_tokens: int = 0
    error: str | None = None


def _metrics(url: str) -> dict[str, float]:
    """A worker's counters summed over labels other than the worker's."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        samples = parse_exposition(resp.read().decode())
    out: dict[str, float] = {}
    for s in samples:
        key = s.name
        if s.name == "pdserve_worker_checkpoint_resumes_total":
            key = f"{s.name}:{s.label('path')}"
        out[key] = out.get(key, 0.0) + s.value
    return out


def _busy_decoder(cluster: ChaosCluster) -> str | None:
    """The decode worker the router has the stream open on."""
    workers = http_json(f"{cluster.router_url}/health")["workers"]
    busy = {w["url"] for w in workers if w["num_inflight"]}  # type: ignore[attr-defined]
    for spec in cluster.specs:
        if spec.role == "decode" and cluster.alive(spec.name) and cluster.url(spec.name) in busy:
            return spec.name
    return None


async def _run_one(config: CostConfig, context: int, mode: str, workdir: Path) -> CostResult:
    result = CostResult(context, mode)
    args = ("--checkpoint", mode, "--max-migrations", "2", "--health-deadline-s", "1")
    workers = tuple(
        WorkerSpec(w.name, w.role, ("--max-model-len", str(context + config.max_tokens + 16)))
        for w in _WORKERS
    )
    cluster = ChaosCluster(workers, args, workdir, config.model)
    try:
        await asyncio.to_thread(cluster.start)
        prompt = [random.Random(context).randrange(3, 2000) for _ in range(context)]
        body: dict[str, object] = {"model": cluster.model_name, "prompt": prompt,
                                   "max_tokens": config.max_tokens, "temperature": 0,
                                   "ignore_eos": True}  # fmt: skip
        killed: dict[str, float] = {}
        before: dict[str, dict[str, float]] = {}

        arrivals: list[tuple[int, float]] = []

        async def on_tokens(num_tokens: int) -> None:
            arrivals.append((num_tokens, time.monotonic()))
            if num_tokens < config.kill_after or "at" in killed:
                return
            victim = await asyncio.to_thread(_busy_decoder, cluster)
            if victim is None:
                return
            for spec in cluster.specs:
                if spec.role == "decode" and spec.name != victim:
                    before[spec.name] = await asyncio.to_thread(_metrics, cluster.url(spec.name))
            await asyncio.to_thread(cluster.kill, victim)
            killed["at"] = time.monotonic()
            result.tokens_at_kill = num_tokens

        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            # Warm-up, as a serving cluster is: two requests at once (one per decode worker,
            # each the other's holder) open the KV connections every later request reuses.
            warm = [{**body, "prompt": [7 + i] * 64, "max_tokens": 40} for i in range(2)]
            await asyncio.gather(*(stream_completion(session, cluster.router_url, w) for w in warm))
            faulted = await stream_completion(session, cluster.router_url, body, on_tokens, 600)
            if faulted.error is not None or "at" not in killed:
                result.error = faulted.error or "no decode worker had the stream at the kill"
                return result
            (survivor,) = before
            after = await asyncio.to_thread(_metrics, cluster.url(survivor))
            reference = await stream_completion(session, cluster.router_url, body, None, 600)
        prior = before[survivor]

        def delta(name: str) -> float:
            return after.get(name, 0.0) - prior.get(name, 0.0)

        computed = int(delta("pdserve_worker_prefill_tokens_total"))
        cached = int(delta("pdserve_worker_prefill_cached_tokens_total"))
        result.admitted_computed_tokens, result.admitted_cached_tokens = computed, cached
        # The resumed request was admitted with prompt + every token sent before it.
        result.tokens_before_resume = computed + cached - context
        result.recomputed_tokens = computed
        # Tokens the dead worker sent before dying may reach the client after the kill: the
        # next token is the first the survivor produced.
        first_new = next((t for n, t in arrivals if n > result.tokens_before_resume), float("nan"))
        result.kill_to_next_token_s = first_new - killed["at"]
        result.pulled_bytes = int(delta("pdserve_worker_checkpoint_pulled_bytes_total"))
        for path in ("checkpoint", "local", "recompute"):
            if delta(f"pdserve_worker_checkpoint_resumes_total:{path}") > 0:
                result.resume_path = path
        result.text_equal = faulted.token_ids == reference.token_ids and not reference.error
    except Exception as exc:  # a broken run is reported, the others still run
        log.exception("checkpoint cost run %s/%s failed", context, mode)
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        await asyncio.to_thread(cluster.stop)
    return result


async def run_costs_async(config: CostConfig) -> list[CostResult]:
    """Every (context, mode) run, one fresh cluster each."""
    with tempfile.TemporaryDirectory(prefix="pdserve-ckpt-costs-") as tmp:
        root = config.workdir or Path(tmp)
        if config.model is None:
            model = build_kv_heavy_checkpoint(root / "long-context-model", LONG_CONTEXT_SHAPE)
            config = CostConfig(**{**asdict(config), "model": str(model)})
        results = []
        for context in config.contexts:
            for mode in config.modes:
                workdir = root / f"ctx{context}-{mode}"
                results.append(await _run_one(config, context, mode, workdir))
        return results


def summarize(results: Sequence[CostResult], block_size: int = 16) -> dict[str, object]:
    """Per context: recovery time ratio on/off; the targets at the longest context."""
    by = {(r.context_tokens, r.mode): r for r in results}
    ratios: dict[str, float | None] = {}
    for context in sorted({r.context_tokens for r in results}):
        on, off = by.get((context, "every-1")), by.get((context, "off"))
        ratio = None
        if on and off and on.kill_to_next_token_s and off.kill_to_next_token_s:
            ratio = on.kill_to_next_token_s / off.kill_to_next_token_s
        ratios[str(context)] = ratio
    longest = max((r.context_tokens for r in results), default=0)
    on_longest = by.get((longest, "every-1"))
    longest_ratio = ratios.get(str(longest))
    return {
        "recovery_ratio_on_over_off": ratios,
        "target_recovery_ratio_le_0.25": longest_ratio is not None and longest_ratio <= 0.25,
        "target_recomputed_lt_one_block": on_longest is not None
        and on_longest.recomputed_tokens is not None
        and on_longest.recomputed_tokens < block_size,
        "all_text_equal": all(r.text_equal for r in results),
    }


def render_table(results: Sequence[CostResult]) -> str:
    """One line per run."""
    lines = [
        f"{'context':>8} {'checkpoints':<12} {'kill->next':>11} {'recomputed':>11}"
        f" {'pulled MiB':>11} {'path':<11} {'text':<6}"
    ]
    for r in results:
        gap = "-" if r.kill_to_next_token_s is None else f"{r.kill_to_next_token_s:.3f} s"
        pulled = "-" if r.pulled_bytes is None else f"{r.pulled_bytes / 2**20:.2f}"
        recomputed = "-" if r.recomputed_tokens is None else str(r.recomputed_tokens)
        text = "equal" if r.text_equal else "DIFF"
        line = f"{r.context_tokens:>8} {r.mode:<12} {gap:>11} {recomputed:>11} {pulled:>11}"
        line += f" {r.resume_path or '-':<11} {text:<6}"
        lines.append(line + (f" error: {r.error}" if r.error else ""))
    return "\n".join(lines)


def run_costs(config: CostConfig) -> int:
    """Run, print the table and summary, write JSON; 1 if a run failed or text differed."""
    results = asyncio.run(run_costs_async(config))
    summary = summarize(results)
    print(render_table(results))
    print(json.dumps(summary, indent=2))
    if config.json_path is not None:
        report = {"results": [asdict(r) for r in results], "summary": summary}
        config.json_path.write_text(json.dumps(report, indent=2) + "\n")
    ok = all(r.error is None for r in results) and summary["all_text_equal"]
    return 0 if ok else 1
