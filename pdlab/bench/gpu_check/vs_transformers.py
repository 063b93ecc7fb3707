"""GPU check step: pdserve's output tokens/s against transformers' `generate` on the same GPU.

The engine benchmark's workloads (`bench/engine.py`) on the roofline checkpoint (Llama-3.2-1B's
shape): batch 1 (a 128-token prompt, 64 new tokens) and mixed batches of 32 and 128 (prompts of
32-256 tokens, 16-128 new tokens each, seeded), greedy with EOS ignored. Both sides warm the same
way and alternate repeats (`compare_case`); pdserve runs with CUDA graphs on, then the same
prompts again on an engine with graphs off, so the graphs' share of the ratio is measured too.
Targets: >= 2x at batch 32, >= 5x at batch 128.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from pdlab.bench.engine import compare_case, random_prompts, run_pdserve
from pdlab.bench.gpu_check.roofline import llama_1b_checkpoint, roofline_engine

TARGETS = {"batch32": 2.0, "batch128": 5.0}


def _workloads(
    vocab: int, batches: tuple[int, ...], quick: bool
) -> list[tuple[str, list[list[int]], list[int], list[list[int]]]]:
    """(case, prompts, max_tokens, warm-up prompts) of every case, seeded."""
    rng = random.Random(0)
    b1_len, b1_new = (32, 8) if quick else (128, 64)
    cases = [
        (
            "batch1",
            random_prompts(rng, vocab, [b1_len]),
            [b1_new],
            random_prompts(rng, vocab, [b1_len]),
        )
    ]
    for n in batches:
        lengths = [rng.randint(32, 256) for _ in range(n)]
        news = [rng.randint(16, 128) // (8 if quick else 1) + 1 for _ in range(n)]
        cases.append(
            (
                f"batch{n}",
                random_prompts(rng, vocab, lengths),
                news,
                random_prompts(rng, vocab, lengths),
            )
        )
    return cases


def run(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every case on both sides (graphs on), then pdserve with graphs off on the same prompts."""
    from transformers import AutoModelForCausalLM

    path = llama_1b_checkpoint(workdir, args)
    batches = (4,) if args.quick else (32, 128)
    repeats = 1 if args.quick else 2
    engine = roofline_engine(path, args, graphs=True, max_batch=max(batches))
    device = engine.kv_cache.device
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype))
    hf = hf.to(device).eval()  # type: ignore[arg-type]
    cases = _workloads(engine.model.config.vocab_size, batches, args.quick)
    results = [
        compare_case(name, engine, hf, prompts, news, warm, repeats)
        for name, prompts, news, warm in cases
    ]
    del engine, hf
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    engine = roofline_engine(path, args, graphs=False, max_batch=max(batches))
    graphs_off: dict[str, float] = {}
    for name, prompts, news, warm in cases:
        run_pdserve(engine, warm, [2] * len(warm), f"warm-off-{name}")
        seconds = statistics.median(
            run_pdserve(engine, prompts, news, f"off-{name}-{r}") for r in range(repeats)
        )
        graphs_off[name] = sum(news) / seconds
    del engine
    print(f"{'case':<10}{'pdserve tok/s':>15}{'no graphs':>12}{'transformers':>14}{'ratio':>8}")
    for r in results:
        print(
            f"{r.case:<10}{r.pdserve_tokens_per_s:>15.0f}{graphs_off[r.case]:>12.0f}"
            f"{r.transformers_tokens_per_s:>14.0f}{r.ratio_vs_transformers:>8.2f}"
        )
    ratios = {r.case: r.ratio_vs_transformers for r in results}
    return {
        "cases": [asdict(r) for r in results],
        "ratio_vs_transformers": ratios,
        "no_graphs_tokens_per_s": graphs_off,
        "no_graphs_ratio_vs_transformers": {
            r.case: graphs_off[r.case] / r.transformers_tokens_per_s for r in results
        },
        "targets": TARGETS,
        "target_met": {case: ratios[case] >= t for case, t in TARGETS.items() if case in ratios},
        "passed": True,
    }
