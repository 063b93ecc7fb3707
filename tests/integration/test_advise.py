"""`pdserve advise` end to end: one cluster switched between colocated and 1:1, JSON and PNGs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(180)
def test_advise_measures_both_arms_on_one_cluster_and_recommends_one(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib", reason="the optional `plot` extra is not installed")
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "# a tiny trace\n"
        '{"prompt_tokens": 40, "output_tokens": 4}\n\n{"prompt_tokens": 120, "output_tokens": 6}\n'
    )
    out, plots = tmp_path / "advise.json", tmp_path / "plots"
    args = ["--workers", "2", "--rates", "2", "--num-requests", "4", "--workload", str(trace)]
    args += ["--slo-ttft-ms", "5000", "--slo-tpot-ms", "1000", "--repeats", "2"]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "advise",
            *args,
            "--json",
            str(out),
            "--plot",
            str(plots),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "PDSERVE_CACHE": str(tiny_model_path.parent)},
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    # Loose SLOs: both arms sustain the rate, so the tie goes to colocated.
    assert "recommendation: colocated (2 workers, each running whole requests)" in r.stdout
    report = json.loads(out.read_text())
    assert [a["name"] for a in report["config"]["arms"]] == ["colocated", "disagg-1:1"]
    assert report["config"]["workload"]["source"] == "trace"
    assert [
        (s["mode"], s["rate"], s["num_requests"], s["num_errors"]) for s in report["results"]
    ] == [
        ("colocated", 2.0, 8, 0),
        ("disagg-1:1", 2.0, 8, 0),
    ]
    assert report["sustained_rate"] == {"colocated": 2.0, "disagg-1:1": 2.0}
    assert set(report["goodput_ratio_disagg_vs_colocated"]) == {"2.0"}
    assert report["recommendation"]["name"] == "colocated" and report["recommendation"]["meets_slo"]
    requests = report["requests"]
    assert len(requests) == 16 and {q["arm"] for q in requests} == {"colocated", "disagg-1:1"}
    # The same lengths for both arms, drawn from the trace's lines.
    sizes = {arm: sorted((q["num_prompt_tokens"], q["num_tokens"]) for q in requests if q["arm"] == arm)
             for arm in ("colocated", "disagg-1:1")}  # fmt: skip
    assert sizes["colocated"] == sizes["disagg-1:1"]
    assert set(sizes["colocated"]) <= {(40, 4), (120, 6)}
    assert {p.name for p in plots.iterdir()} >= {"goodput_vs_rate.png", "latency_cdf.png"}


@pytest.mark.timeout(180)
def test_advise_calibrates_slos_and_rates_on_a_lone_request(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    out = tmp_path / "advise.json"
    args = [
        "--workers",
        "2",
        "--prompt-tokens",
        "64-96",
        "--output-tokens",
        "8",
        "--num-requests",
        "3",
    ]
    args += ["--slo-ttft-x", "50", "--slo-tpot-x", "20", "--rates-x", "0.5", "--calibration-repeats", "2"]  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-m", "pdserve", "advise", *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "PDSERVE_CACHE": str(tiny_model_path.parent)},
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "calibrated on a lone request" in r.stdout
    report = json.loads(out.read_text())
    lone = report["config"]["calibration"]
    assert lone["lone_ttft_ms"] > 0 and lone["lone_tpot_ms"] > 0 and lone["lone_output_tokens"] == 8
    # The SLOs and the rate are the multiples of what the lone request measured.
    assert report["config"]["ttft_slo_ms"] == pytest.approx(50 * lone["lone_ttft_ms"])
    assert report["config"]["tpot_slo_ms"] == pytest.approx(20 * lone["lone_tpot_ms"])
    e2e_s = (lone["lone_ttft_ms"] + 7 * lone["lone_tpot_ms"]) / 1e3
    assert report["config"]["rates"] == [pytest.approx(0.5 / e2e_s, rel=1e-2)]
    assert {s["mode"] for s in report["results"]} == {"colocated", "disagg-1:1"}
