"""`pdserve bench serve` end to end: both modes' clusters, one low rate, JSON and PNGs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# One rate, a handful of short requests: the run is dominated by starting two clusters.
_TINY = ["--rates", "2", "--num-requests", "4", "--seed", "3"]


def _serve(args: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PDSERVE_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "pdserve", "bench", "serve", *_TINY, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


@pytest.mark.timeout(150)
def test_serve_bench_reports_both_modes_and_draws_its_plots(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib", reason="the optional `plot` extra is not installed")
    out, plots = tmp_path / "serve.json", tmp_path / "plots"
    r = _serve(["--json", str(out), "--plot", str(plots)], tiny_model_path.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "goodput at 2 req/s: disagg / colocated" in r.stdout
    report = json.loads(out.read_text())
    assert report["config"]["rates"] == [2.0]
    assert report["config"]["clusters"]["colocated"] == {
        "num_prefill": 0,
        "num_decode": 2,
        "router_args": [],
    }
    assert [(s["mode"], s["rate"]) for s in report["results"]] == [
        ("disagg", 2.0),
        ("colocated", 2.0),
    ]
    for s in report["results"]:
        assert s["num_requests"] == 4 and s["num_errors"] == 0
        assert 0.0 <= s["attainment"] <= 1.0
        assert s["goodput_rps"] <= s["throughput_rps"]
        assert s["ttft_p50_ms"] > 0 and s["tpot_p99_ms"] >= s["tpot_p50_ms"] > 0
    assert set(report["goodput_ratio_disagg_over_colocated"]) == {"2.0"}
    requests = report["requests"]
    assert len(requests) == 8
    # The same seeded workload for both modes, and every request got what it asked for.
    for mode in ("disagg", "colocated"):
        sizes = [(q["num_prompt_tokens"], q["num_tokens"]) for q in requests if q["mode"] == mode]
        assert sizes == [(q["num_prompt_tokens"], q["num_tokens"]) for q in requests[:4]]
    names = {"goodput_vs_rate.png", "latency_cdf.png", "timeline-disagg.png"}
    names.add("timeline-colocated.png")
    assert {p.name for p in plots.iterdir()} == names
    for path in plots.iterdir():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
