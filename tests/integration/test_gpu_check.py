"""`pdserve bench gpu-check` runs every step small on the CPU (`--device cpu --quick`), so the
script a GPU machine runs stays working where none is lent: parity with transformers, the
engine benchmark, and a disaggregated run through real worker processes, with a JSON report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_the_gpu_check_runs_on_the_cpu_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, "-m", "pdserve", "bench", "gpu-check", "--device", "cpu"]
    cmd += ["--dtype", "float32", "--quick", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] is True
    assert report["environment"]["device"] == "cpu"
    fp32, bf16 = report["parity"]
    assert (fp32["dtype"], bf16["dtype"]) == ("float32", "bfloat16")
    assert fp32["tokens_identical"] and fp32["logits_within_tolerance"]
    assert fp32["max_abs_logit_diff"] < 1e-3
    assert bf16["logits_within_tolerance"]
    ratios = report["engine_bench"]["ratio_vs_transformers"]
    assert set(ratios) == {"batch1", "batch8-mixed"} and all(r > 0 for r in ratios.values())
    disagg = report["disaggregated"]
    assert disagg["tokens_identical"] and disagg["handoffs"] == disagg["requests"]
    assert disagg["kv_bytes"] > 0 and disagg["handoff_gb_per_s"] > 0


def test_an_explicit_cuda_without_a_gpu_fails_at_once_naming_why(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "pdserve", "bench", "gpu-check", "--device", "cuda"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    import torch

    if torch.cuda.is_available():
        return
    assert done.returncode != 0
    assert "device: cuda was asked for, but" in done.stderr
