"""`pdserve bench gpu-check` (`make gpu-check`): the engine on a GPU, checked and measured in
one run that fits in 8 minutes on one H200, written as JSON.

1. environment: torch, CUDA, the GPU's name, Triton;
2. parity with transformers on the device, on a random checkpoint of SmolLM-135M's shape: greedy
   tokens of a batch of prompts (pdserve batched, transformers one prompt at a time, so no
   padding enters its side), and the last prompt position's logits, in float32 (tokens must
   be identical) and bfloat16 (logits within the bf16 canary tolerance);
3. `bench engine` on the device at batch 1, 32 and 128 against transformers' `generate` on the
   same device (targets there: >= 2x at batch 32, >= 5x at batch 128);
4. disaggregated: one prefill and one decode worker on the one device (two processes, as
   `pdserve up` starts them) on a KV-heavy checkpoint; greedy text through the router equals
   the offline engine's, and the prefill worker's metrics give the handoff's GB/s.

`--device cpu --quick` runs every step small on the CPU: CI runs it so the script itself stays
working where no GPU is lent. Nothing is downloaded: checkpoints are written here.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

from pdlab.bench.engine_config import EngineBenchConfig
from pdlab.bench.kv_heavy_model import KVHeavyShape, build_kv_heavy_checkpoint
from pdlab.bench.model_shapes import build_shape_checkpoint
from pdserve.config import ModelLoadConfig
from pdserve.engine.canary import TOLERANCES
from pdserve.errors import PdserveError
from pdserve.model.attention import contiguous_metadata
from pdserve.model.device import resolve_device
from pdserve.model.loader import LoadedModel
from pdserve.model.triton_attention import triton_available
from pdserve.observability import metric_names as m
from pdserve.observability.exposition import parse, total
from pdserve.supervise.launcher import Cluster, UpConfig

TARGETS = {"batch32": 2.0, "batch128": 5.0}


class GpuCheckError(PdserveError):
    """A step of the GPU check could not run (its message names the step)."""


def _environment(device: torch.device) -> dict[str, Any]:
    triton_version = None
    if triton_available():
        import triton

        triton_version = triton.__version__
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "triton": triton_version,
    }


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


def _parity(
    path: Path, device: str, dtype: str, prompts: list[list[int]], n: int
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from pdserve.llm import LLM
    from pdserve.protocol.sampling import SamplingParams

    llm = LLM(str(path), dtype=dtype, device=device, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(prompts, params)]
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
    return {
        "dtype": dtype,
        "prompts": len(prompts),
        "new_tokens": n,
        "tokens_identical": same == len(prompts),
        "prompts_identical": same,
        "max_abs_logit_diff": worst,
        "logits_within_tolerance": within,
        "tolerance": {"rtol": rtol, "atol": atol},
    }


def _engine_bench(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    from pdlab.bench.engine import _bench_shape

    config = EngineBenchConfig(
        model=ModelLoadConfig(dtype=args.dtype, device=args.device),
        quick=args.quick,
        repeats=1 if args.quick else 2,
        batches=(8,) if args.quick else (32, 128),
    )
    doc = _bench_shape("smollm-135m", str(path), config)
    ratios: dict[str, float] = doc["ratio_vs_transformers"]  # type: ignore[assignment]
    verdicts = {
        case: ratios[f"{case}-mixed"] >= target
        for case, target in TARGETS.items()
        if f"{case}-mixed" in ratios
    }
    return {**doc, "targets": TARGETS, "target_met": verdicts}


def _scrape(url: str) -> list[Any]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return parse(resp.read().decode())


def _complete(url: str, model: str, prompt: list[int], n: int) -> list[int]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as resp:
        return [int(t) for t in json.loads(resp.read())["choices"][0]["token_ids"]]


def _disaggregated(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.llm import LLM
    from pdserve.protocol.sampling import SamplingParams

    shape = KVHeavyShape(num_layers=2 if args.quick else 16)
    path = build_kv_heavy_checkpoint(workdir / "kv-heavy", shape)
    count, length, n = (2, 64, 4) if args.quick else (6, 1024, 16)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 2000) for _ in range(length)] for _ in range(count)]
    offline = LLM(str(path), device=args.device, kv_cache_bytes=1 << 30)
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in offline.generate(prompts, params)]
    del offline
    up = UpConfig(
        num_prefill=1,
        num_decode=1,
        mode="disagg",
        model=str(path),
        port=0,
        router_args=("--local-prefill-threshold", "0", "--no-breaker"),
        worker_args=("--device", args.device, "--kv-cache-bytes", str(2 << 30)),
        state_file=workdir / "cluster.json",
    )
    cluster = Cluster(up)
    try:
        url = cluster.start()
        names = cluster.supervisor.names()
        prefill = next(cluster.supervisor.url(x) for x in names if x.startswith("prefill"))
        got = [_complete(url, path.name, p, n) for p in prompts]
        sent = _scrape(str(prefill))
    finally:
        cluster.stop()
    seconds = total(sent, m.WORKER_KV_SEND_SECONDS.name + "_sum")
    num_bytes = total(sent, m.WORKER_KV_SEND_BYTES.name + "_sum")
    return {
        "requests": count,
        "prompt_tokens": length,
        "kv_bytes_per_token": shape.kv_bytes_per_token,
        "tokens_identical": got == want,
        "handoffs": total(sent, m.WORKER_KV_SEND_SECONDS.name + "_count"),
        "kv_bytes": num_bytes,
        "send_seconds": seconds,
        "handoff_gb_per_s": num_bytes / seconds / 1e9 if seconds else None,
    }


def run_gpu_check(args: argparse.Namespace) -> int:
    """Run every step, print a summary, write `args.json`; exit status 1 when a check fails."""
    started = time.perf_counter()
    # An explicit cuda without a GPU fails here, before anything is built.
    probe = resolve_device(args.device, args.dtype)
    report: dict[str, Any] = {"environment": _environment(probe)}
    with tempfile.TemporaryDirectory(prefix="pdserve-gpu-check-") as tmp:
        workdir = Path(tmp)
        smollm = build_shape_checkpoint("smollm-135m", workdir / "smollm")
        rng = random.Random(0)
        lengths = [24, 48] if args.quick else [16, 64, 200, 512]
        prompts = [[rng.randrange(3, 40000) for _ in range(k)] for k in lengths]
        n = 8 if args.quick else 32
        dtypes = ["float32", "bfloat16"]
        report["parity"] = [_parity(smollm, args.device, d, prompts, n) for d in dtypes]
        report["engine_bench"] = _engine_bench(smollm, args)
        report["disaggregated"] = _disaggregated(workdir, args)
    report["seconds"] = time.perf_counter() - started
    fp32 = report["parity"][0]
    report["passed"] = bool(
        fp32["tokens_identical"]
        and all(p["logits_within_tolerance"] for p in report["parity"])
        and report["disaggregated"]["tokens_identical"]
    )
    print(
        json.dumps({k: report[k] for k in ("environment", "parity", "seconds", "passed")}, indent=1)
    )
    print("disaggregated:", json.dumps(report["disaggregated"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1
