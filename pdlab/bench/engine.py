"""`pdserve bench engine`: pdserve's engine against transformers' `generate`, side by side.

For each model shape (the tiny default and a random checkpoint of SmolLM-135M's shape written
by transformers, or one `--model` folder), in one process, greedy, EOS ignored so both sides
produce the same number of tokens:
- batch 1: a 128-token prompt, 64 new tokens;
- batch 32 (or each `--batch`): prompt lengths 32–256 and max_tokens 16–128 (seeded).
  transformers pads the batch and runs to the longest max_tokens; only the tokens each request
  asked for count as output;
- on the CPU, the decode step's breakdown at batch 1 and the first batch size
  (`step_breakdown`: model, attention, gathers, logits, sampler, Python), timed in a run of
  its own;
- shared prefix: 90% of every prompt is shared; mean TTFT with prefix caching on and off.

Fair by construction: both sides are warmed the same way, with a prompt of their own that is
never timed, and the throughput cases run with prefix caching off, so no timed prompt finds
its own blocks cached (an earlier version warmed pdserve alone, with the timed prompt, so the
timed batch-1 run prefilled 16 of its 128 tokens). Ratios are what matter on a noisy machine:
both sides see the same noise. Each case runs `--repeats` times (default 3), the two sides
alternating and the first side swapping every repeat; a side's figure is its median, and every
run is in the JSON (one run of a 0.1 s batch-1 case moved the ratio by 25% between two runs).
`--device cuda` runs both sides on the GPU (each timed run ends with a synchronize).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from pdlab.bench.engine_config import DEFAULT_SHAPES, EngineBenchConfig, config_from_args
from pdlab.bench.model_shapes import build_shape_checkpoint
from pdlab.bench.step_breakdown import PARTS, measure_decode_breakdown
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.model.tiny import default_model_path
from pdserve.protocol.sampling import SamplingParams


@dataclass(slots=True)
class CaseResult:
    """Throughput of one workload on both sides."""

    case: str
    num_requests: int
    output_tokens: int
    pdserve_tokens_per_s: float
    transformers_tokens_per_s: float
    ratio_vs_transformers: float
    # Seconds of every timed run, in order (the figures above are their medians).
    pdserve_runs_s: list[float]
    transformers_runs_s: list[float]


def random_prompts(rng: random.Random, vocab: int, lengths: list[int]) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def run_pdserve(engine: Engine, prompts: list[list[int]], max_tokens: list[int], tag: str) -> float:
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        params = SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", p, params)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def run_transformers(hf: torch.nn.Module, prompts: list[list[int]], max_tokens: list[int]) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    n = max(max_tokens)
    device = next(hf.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        hf.generate(  # type: ignore[operator]
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    sync(device)
    return time.perf_counter() - start


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer measures it (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare_case(
    name: str,
    engine: Engine,
    hf: torch.nn.Module,
    prompts: list[list[int]],
    max_tokens: list[int],
    warm: list[list[int]],
    repeats: int = 1,
) -> CaseResult:
    # The same warm-up on both sides (first-call allocations, kernel choices), with prompts
    # of the case's lengths that are never timed; the engine caches no prefix (see the doc).
    run_pdserve(engine, warm, [2] * len(warm), f"warm-{name}")
    run_transformers(hf, warm, [2] * len(warm))
    t_pd: list[float] = []
    t_hf: list[float] = []
    for r in range(repeats):
        for side in ("pdserve", "transformers") if r % 2 == 0 else ("transformers", "pdserve"):
            if side == "pdserve":
                t_pd.append(run_pdserve(engine, prompts, max_tokens, f"{name}-{r}"))
            else:
                t_hf.append(run_transformers(hf, prompts, max_tokens))
    out = sum(max_tokens)
    pd, hf_s = statistics.median(t_pd), statistics.median(t_hf)
    return CaseResult(name, len(prompts), out, out / pd, out / hf_s, hf_s / pd, t_pd, t_hf)


def _prefix_ttft(path: str, cfg: EngineConfig, prompts: list[list[int]], on: bool) -> float:
    engine = Engine.from_config(
        EngineConfig(
            block_size=cfg.block_size,
            kv_cache_bytes=cfg.kv_cache_bytes,
            enable_prefix_caching=on,
            model=cfg.model,
        )
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request("warm", prompts[0], params)
    while engine.has_unfinished():
        engine.step()
    requests = [engine.add_request(f"p{i}", p, params) for i, p in enumerate(prompts[1:])]
    while engine.has_unfinished():
        engine.step()
    ttfts = [(r.first_token_ns or 0) - r.arrival_ns for r in requests]
    return sum(ttfts) / len(ttfts) / 1e9


def _shape_paths(config: EngineBenchConfig, workdir: Path) -> list[tuple[str, str]]:
    """(name, folder) of every model to measure: `--model`, else the asked shapes."""
    if config.model.path:
        return [("custom", config.model.path)]
    names = config.model_shapes or (["tiny"] if config.quick else list(DEFAULT_SHAPES))
    paths = []
    for name in names:
        if name == "tiny":
            paths.append((name, str(default_model_path())))
        else:
            paths.append((name, str(build_shape_checkpoint(name, workdir / name))))
    return paths


def _bench_shape(name: str, path: str, config: EngineBenchConfig) -> dict[str, object]:
    """Every case on one checkpoint; prints its table and returns its JSON part."""
    from transformers import AutoModelForCausalLM

    batches = config.batches or ([8] if config.quick else [32])
    cfg = EngineConfig(
        block_size=config.block_size,
        enable_prefix_caching=False,
        max_num_seqs=max(64, *batches),
        model=replace(config.model, path=path),
    )
    engine = Engine.from_config(cfg)
    device = engine.kv_cache.device
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, cfg.model.dtype))
    hf = hf.to(device).eval()  # type: ignore[arg-type]
    vocab = engine.model.config.vocab_size
    rng = random.Random(0)
    quick = config.quick
    b1_len, b1_new = (32, 16) if quick else (128, 64)
    repeats = 1 if quick else config.repeats
    results = [
        compare_case(
            "batch1",
            engine,
            hf,
            random_prompts(rng, vocab, [b1_len]),
            [b1_new],
            random_prompts(rng, vocab, [b1_len]),
            repeats,
        )
    ]
    for n_batch in batches:
        lengths = [rng.randint(32, 256) for _ in range(n_batch)]
        news = [rng.randint(16, 128) for _ in range(n_batch)]
        if quick:
            news = [max(4, n // 8) for n in news]
        results.append(
            compare_case(
                f"batch{n_batch}-mixed",
                engine,
                hf,
                random_prompts(rng, vocab, lengths),
                news,
                random_prompts(rng, vocab, lengths),
                repeats,
            )
        )
    num_steps = 4 if quick else 16
    # Timed by wall clock around each part: meaningless for a GPU's asynchronous kernels.
    breakdown = (
        {
            f"batch{n}": measure_decode_breakdown(
                engine, random_prompts(rng, vocab, [b1_len] * n), num_steps, f"breakdown{n}"
            )
            for n in (1, batches[0])
        }
        if device.type == "cpu"
        else {}
    )
    n_prefix, prompt_len = (5, 128) if quick else (17, 512)
    shared = random_prompts(rng, vocab, [int(prompt_len * 0.9)])[0]
    tails = random_prompts(rng, vocab, [prompt_len - len(shared)] * n_prefix)
    prefix_prompts = [shared + t for t in tails]
    ttft_off = _prefix_ttft(path, cfg, prefix_prompts, on=False)
    ttft_on = _prefix_ttft(path, cfg, prefix_prompts, on=True)

    print(
        f"model: {name} ({path})  dtype: {cfg.model.dtype}  quantization: {cfg.model.quantization}"
        f"  device: {device}"
    )
    print(
        f"{'case':<18}{'requests':>9}{'out tok':>9}{'pdserve tok/s':>15}"
        f"{'transformers tok/s':>20}{'ratio':>8}"
    )
    for r in results:
        print(
            f"{r.case:<18}{r.num_requests:>9}{r.output_tokens:>9}{r.pdserve_tokens_per_s:>15.1f}"
            f"{r.transformers_tokens_per_s:>20.1f}{r.ratio_vs_transformers:>8.2f}"
        )
    print(f"decode step (ms): {'batch':<8}" + "".join(f"{p:>10}" for p in (*PARTS, "step")))
    for batch, parts in breakdown.items():
        print(f"{'':<18}{batch:<8}" + "".join(f"{parts[p]:>10.2f}" for p in (*PARTS, "step")))
    speedup = ttft_off / ttft_on
    print(
        f"shared prefix (90%, {n_prefix - 1} requests of {prompt_len} tokens): mean TTFT "
        f"{ttft_off * 1e3:.1f} ms without prefix cache, {ttft_on * 1e3:.1f} ms with "
        f"({speedup:.2f}x)"
    )
    print()
    return {
        "model": path,
        "device": str(device),
        "num_parameters": sum(p.numel() for p in hf.parameters()),
        "cases": [asdict(r) for r in results],
        "ratio_vs_transformers": {r.case: r.ratio_vs_transformers for r in results},
        "decode_step_ms": breakdown,
        "prefix_cache_ttft_s": {"off": ttft_off, "on": ttft_on},
        "prefix_cache_ttft_speedup": speedup,
    }


def run_engine_bench(args: argparse.Namespace) -> int:
    """Run every case on every shape, print the tables, write JSON if asked; returns the exit
    status."""
    config = config_from_args(args)
    shapes: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-engine-") as tmp:
        for name, path in _shape_paths(config, Path(tmp)):
            shapes[name] = _bench_shape(name, path, config)
    if config.json_path:
        ratios = {
            f"{name}/{case}": ratio
            for name, doc in shapes.items()
            for case, ratio in doc["ratio_vs_transformers"].items()  # type: ignore[attr-defined]
        }
        with open(config.json_path, "w") as f:
            json.dump({"shapes": shapes, "ratio_vs_transformers": ratios}, f, indent=2)
    return 0
