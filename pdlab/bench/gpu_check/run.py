"""Run the GPU check's steps in order, most important first, and report each as it ends.

    parity           float32 tokens and bfloat16 logits against transformers; graphs on = off
    roofline         batch 1/32/128 decode step time against the HBM floor, graphs on and off
    vs_transformers  output tokens/s against transformers at batch 1, 32 and 128
    device_transfer  KV blocks between two processes over CUDA IPC, checksummed on the device
    disaggregated    a prefill and a decode worker on the one GPU: same text, handoff GB/s
    device_faults    a decode worker killed and one paused past its lease mid-transfer
    cuda_tests       the CUDA unit tests and the Triton kernel tests (they skip without a GPU)

Each step's JSON goes to `<out>/NN-step.json` the moment it ends, and `<out>/gpu_check.json`
(environment, every step so far) is rewritten after each, so a run cut short by the device's
time limit still reports what it measured. A step that raises is recorded with its error and
the next one runs; one that would start after `--budget-s` is recorded as skipped. `--step`
runs only the named steps (a rerun of what failed). The exit status is 0 only when every step
ran and passed.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from pdlab.bench.gpu_check import STEPS
from pdserve.model.device import resolve_device
from pdserve.model.triton_attention import triton_available


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and the device, for the report's header."""
    triton_version = None
    if triton_available():
        import triton

        triton_version = triton.__version__
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "device_name": "cpu",
        "triton": triton_version,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["device_name"] = props.name
        env["device_memory_bytes"] = props.total_memory
        env["compute_capability"] = f"{props.major}.{props.minor}"
        env["driver"] = _driver_version()
    return env


def _driver_version() -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout else None


def step_function(name: str) -> Callable[[Path, argparse.Namespace], dict[str, Any]]:
    """The step's `run`, imported now: a step whose import fails is that step's failure."""
    module = importlib.import_module(f"pdlab.bench.gpu_check.{name}")
    return cast(Callable[[Path, argparse.Namespace], dict[str, Any]], module.run)


def _run_step(name: str, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    try:
        result = step_function(name)(workdir, args)
    except Exception as exc:  # a failed step is reported and the next one runs
        result = {
            "passed": False,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc().splitlines()[-30:],
        }
    result["seconds"] = time.perf_counter() - started
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def run_gpu_check(args: argparse.Namespace) -> int:
    """Run the steps, writing each one's JSON as it ends; exit status 1 when one failed."""
    started = time.perf_counter()
    steps = [s for s in STEPS if not args.step or s in args.step]
    # An explicit cuda without a GPU fails here, before anything is built.
    probe = resolve_device(args.device, args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    combined = out / "gpu_check.json"
    # A rerun of some steps (`--step`) keeps the earlier run's other steps in the report.
    earlier = json.loads(combined.read_text())["steps"] if args.step and combined.exists() else {}
    report: dict[str, Any] = {"environment": environment(probe), "steps": earlier}
    print("environment:", json.dumps(report["environment"]), flush=True)
    with tempfile.TemporaryDirectory(prefix="pdserve-gpu-check-") as tmp:
        for name in steps:
            elapsed = time.perf_counter() - started
            if elapsed > args.budget_s:
                result: dict[str, Any] = {"passed": False, "skipped": f"budget ({elapsed:.0f} s)"}
            else:
                print(f"== {name}", flush=True)
                result = _run_step(name, Path(tmp), args)
            report["steps"][name] = result
            report["seconds"] = time.perf_counter() - started
            report["passed"] = all(r["passed"] for r in report["steps"].values())
            number = STEPS.index(name) + 1
            (out / f"{number:02d}-{name}.json").write_text(json.dumps(result, indent=2))
            combined.write_text(json.dumps(report, indent=2))
            verdict = "passed" if result["passed"] else result.get("skipped", "FAILED")
            print(f"== {name}: {verdict} ({result.get('seconds', 0):.1f} s)", flush=True)
            if "error" in result:
                print("\n".join(result["traceback"]), file=sys.stderr, flush=True)
    print(f"gpu check: {'passed' if report['passed'] else 'FAILED'} in {report['seconds']:.0f} s")
    return 0 if report["passed"] else 1
