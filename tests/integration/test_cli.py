"""The `pdserve` command as a user runs it: a real subprocess on the tiny default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def pdserve(args: list[str], cache: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PDSERVE_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "pdserve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_generate_prints_the_prompt_and_a_completion(tiny_model_path: Path) -> None:
    cache = tiny_model_path.parent
    a = pdserve(["generate", "Hello there", "--max-tokens", "8"], cache)
    assert a.returncode == 0, a.stderr
    assert a.stdout.startswith("Hello there")
    assert len(a.stdout.strip()) > len("Hello there")
    b = pdserve(["generate", "Hello there", "--max-tokens", "8"], cache)
    assert b.stdout == a.stdout  # greedy by default: deterministic


def test_seeded_sampling_is_reproducible_across_processes(tiny_model_path: Path) -> None:
    cache = tiny_model_path.parent
    args = ["generate", "Once", "--max-tokens", "12", "--temperature", "1.0", "--seed", "5"]
    assert pdserve(args, cache).stdout == pdserve(args, cache).stdout


def test_bad_flags_give_one_clear_line_and_status_2(tiny_model_path: Path) -> None:
    cache = tiny_model_path.parent
    r = pdserve(["generate", "x", "--max-tokens", "0"], cache)
    assert r.returncode == 2 and "expected a positive integer" in r.stderr
    r = pdserve(["generate", "x", "--temperature", "-1"], cache)
    assert r.returncode == 2 and "temperature" in r.stderr
    r = pdserve(["generate", "x", "--model", str(cache / "nope")], cache)
    assert r.returncode == 2 and "nope" in r.stderr and "Traceback" not in r.stderr


def test_device_flags_resolve_or_fail_naming_why(tiny_model_path: Path, tmp_path: Path) -> None:
    """`--device cpu` runs; on a machine without a GPU an explicit cuda, and float16 anywhere
    it is not served, fail at start with the field and the reason, no traceback; so does a
    worker asked for cuda."""
    import torch

    cache = tiny_model_path.parent
    r = pdserve(["generate", "Hi", "--max-tokens", "4", "--device", "cpu"], cache)
    assert r.returncode == 0, r.stderr
    if torch.cuda.is_available():
        return
    r = pdserve(["generate", "Hi", "--device", "cuda"], cache)
    assert r.returncode == 2 and "device: cuda was asked for, but" in r.stderr
    assert "Traceback" not in r.stderr
    r = pdserve(["generate", "Hi", "--dtype", "float16"], cache)
    assert r.returncode == 2 and "dtype: 'float16' is not served on cpu" in r.stderr
    r = pdserve(["generate", "Hi", "--device", "tpu"], cache)
    assert r.returncode == 2 and "--device" in r.stderr
    worker = subprocess.run(
        [sys.executable, "-m", "pdserve", "worker", "--device", "cuda", "--insecure-no-auth"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PDSERVE_CACHE": str(cache)},
        cwd=tmp_path,
        check=False,
    )
    assert worker.returncode != 0 and "device: cuda was asked for" in worker.stderr
    assert "Traceback" not in worker.stderr


def test_bench_engine_quick_writes_ratios(tiny_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    r = pdserve(["bench", "engine", "--quick", "--json", str(out)], tiny_model_path.parent, 600)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert set(data["ratio_vs_transformers"]) == {"tiny/batch1", "tiny/batch8-mixed"}
    assert all(v > 0 for v in data["ratio_vs_transformers"].values())
    tiny = data["shapes"]["tiny"]
    assert tiny["prefix_cache_ttft_speedup"] > 0
    # The decode step's parts, at batch 1 and 8, add up to the step.
    for parts in tiny["decode_step_ms"].values():
        named = sum(v for k, v in parts.items() if k != "step")
        assert parts["step"] > 0 and abs(named - parts["step"]) < 1e-6
    assert "ratio" in r.stdout and "decode step" in r.stdout


def _children(pid: int) -> list[int]:
    """Live children of `pid` (from /proc: no `ps` dependency)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == pid and stat[0] != "Z":
            kids.append(int(entry.name))
    return kids


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "pdserve", "chaos", "--checkpoint-costs", "--contexts", "8192"],
        [str(REPO / "benchmarks" / "checkpoint_tpot.py"), "--rounds", "100"],
    ],
    ids=["pdserve-chaos", "benchmarks-script"],
)
def test_a_sigterm_stops_the_cluster_a_run_started(
    tiny_model_path: Path, tmp_path: Path, command: list[str]
) -> None:
    """`pdserve chaos` (and bench, advise) and the benchmark scripts stop every process they
    started when terminated, by PID, instead of leaving workers behind."""
    import signal
    import time

    env = {**os.environ, "PDSERVE_CACHE": str(tiny_model_path.parent), "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, *command],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while len(kids := _children(proc.pid)) < 3:
            assert proc.poll() is None, "the chaos run ended before its cluster started"
            assert time.monotonic() < deadline, "no cluster within 120 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 15
        while left := [k for k in kids if Path(f"/proc/{k}").exists()]:
            assert time.monotonic() < deadline, f"left behind: {left}"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
