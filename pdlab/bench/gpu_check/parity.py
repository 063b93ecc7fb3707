"""GPU check step: pdserve's numbers against transformers' on the same device.

On a random checkpoint of SmolLM-135M's shape, a batch of prompts:
- float32: greedy tokens identical (pdserve batched, transformers one prompt at a time, so no
  padding enters its side) and the last prompt position's logits within the canary tolerance;
- bfloat16: logits within the bfloat16 canary tolerance (greedy tokens are reported, not
  required: bfloat16 rounding may flip a near tie);
- CUDA graphs on against off: identical greedy tokens, with whether graphs were captured at
  all (on the CPU they never are, and the comparison proves nothing there).
"""

from __future__ import annotations

import argparse
import gc
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pdlab.bench.model_shapes import build_shape_checkpoint
from pdserve.engine.canary import TOLERANCES
from pdserve.model.attention import contiguous_metadata
from pdserve.model.loader import LoadedModel

if TYPE_CHECKING:
    from pdserve.llm import LLM


def _pdserve_logits(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Logits [vocab] (float32, CPU) of the last position, one prefill over a fresh cache."""
    bs = model.fingerprint.kv_block_size
    meta, num_blocks = contiguous_metadata([len(ids)], [len(ids)], bs, model.device)
    c = model.config
    dtype = next(model.module.parameters()).dtype
    kv = torch.zeros(
        (num_blocks, c.num_layers, 2, bs, c.num_kv_heads, c.head_dim),
        dtype=dtype,
        device=model.device,
    )
    pos = torch.arange(len(ids), device=model.device)
    hidden = model.module(torch.tensor(ids, device=model.device), pos, kv, meta)
    return model.module.compute_logits(hidden[-1:])[0].float().cpu()


def _greedy(
    path: Path, device: str, dtype: str, prompts: list[list[int]], n: int, graphs: bool
) -> tuple[list[list[int]], bool, LLM]:
    """(greedy tokens of every prompt, whether decode ran through captured graphs, the LLM)."""
    from pdserve.llm import LLM
    from pdserve.protocol.sampling import SamplingParams

    llm = LLM(
        str(path), dtype=dtype, device=device, enable_prefix_caching=False, cuda_graphs=graphs
    )
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    tokens = [o.token_ids for o in llm.generate(prompts, params)]
    return tokens, llm.engine.runner.graphs is not None, llm


def _against_transformers(
    path: Path, device: str, dtype: str, prompts: list[list[int]], n: int
) -> tuple[dict[str, Any], list[list[int]]]:
    """The comparison's report, and pdserve's greedy tokens (graphs on where they exist)."""
    from transformers import AutoModelForCausalLM

    ours, captured, llm = _greedy(path, device, dtype, prompts, n, graphs=True)
    model = llm.engine.model
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
    hf = hf.to(model.device).eval()  # type: ignore[arg-type]
    theirs: list[list[int]] = []
    worst = 0.0
    rtol, atol = TOLERANCES[dtype]
    within = True
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            out = hf.generate(
                input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
            theirs.append([int(t) for t in out[0, len(p) :].tolist()])
            want = hf(ids).logits[0, -1].float().cpu()
            got = _pdserve_logits(model, p)
            diff = (got - want).abs()
            worst = max(worst, float(diff.max()))
            within &= bool((diff <= atol + rtol * want.abs()).all())
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    report = {
        "dtype": dtype,
        "prompts": len(prompts),
        "new_tokens": n,
        "graphs_captured": captured,
        "tokens_identical": same == len(prompts),
        "prompts_identical": same,
        "max_abs_logit_diff": worst,
        "logits_within_tolerance": within,
        "tolerance": {"rtol": rtol, "atol": atol},
    }
    return report, ours


def _graphs_off(
    path: Path, device: str, dtype: str, prompts: list[list[int]], n: int, on: list[list[int]]
) -> dict[str, Any]:
    """Greedy tokens with graphs off against `on`, the same prompts' tokens with graphs on."""
    gc.collect()
    off, _, _ = _greedy(path, device, dtype, prompts, n, graphs=False)
    same = sum(a == b for a, b in zip(on, off, strict=True))
    return {
        "dtype": dtype,
        "tokens_identical": same == len(prompts),
        "prompts_identical": same,
    }


def run(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """float32 and bfloat16 against transformers, then graphs on against off (bfloat16)."""
    path = build_shape_checkpoint("smollm-135m", workdir / "smollm")
    rng = random.Random(0)
    lengths = [24, 48] if args.quick else [16, 64, 200, 512]
    prompts = [[rng.randrange(3, 40000) for _ in range(k)] for k in lengths]
    n = 8 if args.quick else 32
    fp32, _ = _against_transformers(path, args.device, "float32", prompts, n)
    bf16, bf16_tokens = _against_transformers(path, args.device, "bfloat16", prompts, n)
    # The bfloat16 run above had graphs on: only the graphs-off side runs again.
    graphs = _graphs_off(path, args.device, "bfloat16", prompts, n, bf16_tokens)
    graphs["graphs_captured"] = bf16["graphs_captured"]
    passed = (
        fp32["tokens_identical"]
        and fp32["logits_within_tolerance"]
        and bf16["logits_within_tolerance"]
        and graphs["tokens_identical"]
    )
    return {"float32": fp32, "bfloat16": bf16, "cuda_graphs": graphs, "passed": passed}
