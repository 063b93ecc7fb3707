"""`pdserve bench gpu-check` runs its steps small on the CPU (`--device cpu --quick`), so the
script a GPU machine runs stays working where none is lent: parity with transformers, the
decode roofline, speed against transformers and a disaggregated run through real worker
processes, each step's JSON written as it ends. (The device transfer and device fault steps
have tests of their own: `test_gpu_check_device_transfer.py`, `tests/chaos/`.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

STEPS = ("parity", "roofline", "vs_transformers", "disaggregated")


def test_the_gpu_check_runs_on_the_cpu_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "pdserve", "bench", "gpu-check", "--device", "cpu"]
    cmd += ["--dtype", "float32", "--quick", "--out", str(out)]
    for step in STEPS:
        cmd += ["--step", step]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["passed"] is True and list(report["steps"]) == list(STEPS)
    assert report["environment"]["device"] == "cpu"
    assert sorted(p.name for p in out.glob("0*.json")) == [
        "01-parity.json",
        "02-roofline.json",
        "03-vs_transformers.json",
        "05-disaggregated.json",
    ]
    parity = report["steps"]["parity"]
    fp32, bf16 = parity["float32"], parity["bfloat16"]
    assert fp32["tokens_identical"] and fp32["logits_within_tolerance"]
    assert fp32["max_abs_logit_diff"] < 1e-3
    assert bf16["logits_within_tolerance"]
    # No graphs on the CPU: the on/off comparison says so rather than claiming anything.
    assert parity["cuda_graphs"]["graphs_captured"] is False
    roofline = report["steps"]["roofline"]
    assert {(r["graphs"], r["batch"]) for r in roofline["rows"]} == {
        (g, b) for g in (True, False) for b in (1, 4)
    }
    assert all(r["us_per_step"] > 0 and r["tokens_per_s"] > 0 for r in roofline["rows"])
    # No published bandwidth for a CPU: no fraction is made up.
    assert roofline["peak_hbm_bytes_per_s"] is None and roofline["batch1_fraction_of_floor"] is None
    assert roofline["measured_copy_bytes_per_s"] > 0
    ratios = report["steps"]["vs_transformers"]["ratio_vs_transformers"]
    assert set(ratios) == {"batch1", "batch4"} and all(r > 0 for r in ratios.values())
    disagg = report["steps"]["disaggregated"]
    assert disagg["tokens_identical"] and disagg["handoffs"] == disagg["requests"]
    assert disagg["kv_bytes"] > 0 and disagg["handoff_gb_per_s"] > 0
    # A CPU cache is not staged: nothing crossed a host mirror, and the report says so.
    assert disagg["host_staged_bytes"] == {"out": 0, "in": 0}
    assert disagg["kv_path"] == "cache memory"
    # The handoff happens after the first token: it shows in the gap, not in TTFT.
    assert disagg["mean_ttft_s"] > 0 and disagg["mean_tpot_s"] > 0
    assert 0 < disagg["mean_transfer_s"] < disagg["mean_handoff_gap_s"]
    assert disagg["handoff_gap_in_tpots"] > 0


def test_an_explicit_cuda_without_a_gpu_fails_at_once_naming_why(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "pdserve", "bench", "gpu-check", "--device", "cuda"]
    cmd += ["--out", str(tmp_path / "out")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    import torch

    if torch.cuda.is_available():
        return
    assert done.returncode != 0
    assert "device: cuda was asked for, but" in done.stderr


def test_make_gpu_check_writes_its_log_and_json_where_the_device_tool_collects_them(
    tmp_path: Path,
) -> None:
    # The recipe a GPU machine runs, here with the venv's python and the CPU: no wheels to
    # install, the report and the log under $OUT, and the check's exit status kept.
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    env["OUT"] = str(out)
    make = ["make", "-s", "-C", str(repo), "gpu-check", f"GPU_PY={sys.executable}"]
    make += ["GPU_CHECK_DEVICE=cpu", f"GPU_WHEELS_DIR={tmp_path / 'no-wheels'}"]
    done = subprocess.run(
        [*make, "GPU_CHECK_ARGS=--quick --step roofline"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "== roofline: passed" in (out / "gpu_check.log").read_text()
    assert json.loads((out / "gpu_check.json").read_text())["passed"] is True
    assert (out / "02-roofline.json").exists()
    failed = subprocess.run(
        [*make, "GPU_CHECK_ARGS=--quick --step no-such-step"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert failed.returncode != 0 and "invalid choice" in (out / "gpu_check.log").read_text()
