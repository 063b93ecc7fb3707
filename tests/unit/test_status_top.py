"""`pdserve status` grouping and table, `pdserve top` frames: pure rendering, exact output."""

from __future__ import annotations

import io
import math

import pytest

from pdserve.cli import top
from pdserve.cli.status import ClusterStatus, WorkerRow, fingerprint_groups, render_table
from pdserve.cli.top import histogram_quantile, render_metrics
from pdserve.observability.exposition import parse
from pdserve.router.metrics import RouterMetrics


def _rows() -> tuple[WorkerRow, ...]:
    return (
        WorkerRow("http://a", True, "prefill", 11, "p-1", "aaaa" * 4, 64, 60, 0, 0, 0),
        WorkerRow("http://b", True, "both", 12, "d-1", "aaaa" * 4, 64, 50, 4, 1, 2, device="cuda"),
        WorkerRow("http://c", True, "both", 13, "d-2", "bbbb" * 4, 64, 64, 0, 0, 0),
        WorkerRow("http://d", False, error="URLError: refused"),
    )


def test_groups_put_the_largest_first_and_mark_the_router_s_group() -> None:
    groups = fingerprint_groups(_rows(), "aaaa" * 4)
    assert [(g.name, g.worker_ids, g.compatible) for g in groups] == [
        ("A", ("p-1", "d-1"), True),
        ("B", ("d-2",), False),
    ]


def test_the_table_shows_groups_breaker_mode_and_down_workers() -> None:
    rows = _rows()
    differs = {"bbbb" * 4: ("dtype: bfloat16 != float32",)}
    status = ClusterStatus(
        "http://r", 7, "degraded", "disagg", "tiny", rows, "colocated", "open", 0.6, "aaaa" * 4,
        fingerprint_groups(rows, "aaaa" * 4, differs), ("pool B cannot pair",),
    )  # fmt: skip
    lines = render_table(status).splitlines()
    assert lines[0] == (
        "router http://r  pid 7  status degraded  mode disagg  effective colocated  breaker open"
        " (60% failed)  model tiny"
    )
    assert lines[1].split() == [
        "worker", "role", "pid", "url", "grp", "dev", "fingerprint", "free/total", "pinned", "run",
        "wait", "lease", "infl", "instance", "rst",
    ]  # fmt: skip
    assert lines[3].split() == ["d-1", "both", "12", "http://b", "-", "cuda", "aaaaaaaaaaaa", "50/64",
                                "4", "1", "2", "-", "-", "-", "-"]  # fmt: skip
    assert lines[5].split()[:3] == ["?", "down", "http://d"]
    assert lines[6] == "group A aaaaaaaaaaaa: 2 worker(s) p-1, d-1 (compatible)"
    assert lines[7] == (
        "group B bbbbbbbbbbbb: 1 worker(s) d-2 (not paired by the router);"
        " differs: dtype: bfloat16 != float32"
    )
    assert lines[8] == "problem: pool B cannot pair"


def test_quantiles_come_from_the_bucket_bounds() -> None:
    metrics = RouterMetrics()
    for v in (0.004, 0.004, 0.2, 40.0):
        metrics.ttft_s.observe(v)
    samples = parse(metrics.render())
    assert histogram_quantile(samples, "pdserve_router_ttft_seconds", 0.5) == 0.005
    assert histogram_quantile(samples, "pdserve_router_ttft_seconds", 0.75) == 0.25
    assert histogram_quantile(samples, "pdserve_router_ttft_seconds", 1.0) == math.inf
    assert histogram_quantile(samples, "pdserve_router_tpot_seconds", 0.5) is None


def test_the_metric_lines_show_rates_since_the_previous_frame() -> None:
    before = RouterMetrics()
    before.count_request("disagg", "ok")
    after = RouterMetrics()
    for status in ("ok", "ok", "ok", "error"):
        after.count_request("disagg", status)
    after.retries["reprefill"] += 2
    after.ttft_s.observe(0.02)
    lines = render_metrics(parse(after.render()), parse(before.render()), 2.0)
    assert lines[0] == "requests 4 (ok 3, other 1)  rate 1.5/s"
    assert lines[1].split() == ["ttft", "p50", "≤25ms", "p95", "≤25ms", "n", "1"]
    assert lines[-1] == "retries reprefill=2  fallbacks 0  migrations 0"
    assert render_metrics(parse(after.render()), None, 2.0)[0].endswith("rate -")


def test_top_once_draws_one_frame_without_escape_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    status = ClusterStatus("http://r", 7, "ok", "disagg", "tiny", _rows())
    monkeypatch.setattr(top, "collect_status", lambda url: status)
    monkeypatch.setattr(top, "fetch_metrics", lambda url: parse(RouterMetrics().render()))
    out = io.StringIO()
    assert top.run_top("http://r", 1.0, once=True, out=out) == 0
    assert "\x1b[" not in out.getvalue() and "router http://r" in out.getvalue()
    live = io.StringIO()
    assert top.run_top("http://r", 1.0, False, live, lambda s: None, max_frames=2) == 0
    assert live.getvalue().count(top.CLEAR) == 2


def test_top_shows_interference_slo_attainment_and_the_auto_layout() -> None:
    from pdserve.cli.top import render_interference
    from pdserve.clock import FakeClock
    from pdserve.observability.request_stats import RequestStats
    from pdserve.protocol.worker_api import StepInfo
    from pdserve.router.mode.interference import SLOConfig
    from pdserve.router.mode.live_monitor import LiveMonitor

    monitor = LiveMonitor(SLOConfig(ttft_s=1.0, tpot_s=0.01), 10.0, FakeClock())
    tracker = monitor.begin(100, 4)
    for gap, prefill in ((None, 100), (0.004, 0), (0.002, 0), (0.090, 700)):
        info = StepInfo(index=0, duration_s=0.001, num_prefill_tokens=prefill,
                        num_decode_tokens=1, decode=gap is not None)  # fmt: skip
        monitor.chunk(tracker, info, gap, 1)
    monitor.end(tracker, RequestStats(0.2, 0.3, 0.032, None), finished=True)
    metrics = RouterMetrics(extra=[monitor.render])
    lines = render_interference(parse(metrics.render()))
    assert lines[0].split() == [
        "decode", "tpot", "with", "prefill", "mean", "90.0ms", "p50", "≤100ms", "p95", "≤100ms",
        "n", "1",
    ]  # fmt: skip
    assert lines[1].split()[:6] == ["decode", "tpot", "without", "prefill", "mean", "3.0ms"]
    assert lines[2] == (
        "slo ttft 1000ms tpot 10ms  window attainment ttft 1.00  tpot 0.00  both 0.00"
        "  since start missed_tpot=1"
    )
    assert render_interference(parse(RouterMetrics().render())) == []


def test_status_marks_roles_the_router_assigned_and_auto_mode() -> None:
    rows = (
        WorkerRow("http://a", True, "both", 11, "w-1", "aaaa" * 4, 64, 60, 0, 0, 0,
                  assigned_role="prefill"),
        WorkerRow("http://b", True, "both", 12, "w-2", "aaaa" * 4, 64, 60, 0, 0, 0),
    )  # fmt: skip
    status = ClusterStatus("http://r", 7, "ok", "disagg", "tiny", rows, mode_setting="auto")
    lines = render_table(status).splitlines()
    assert "mode auto (disagg now)" in lines[0]
    assert lines[2].split()[:2] == ["w-1", "prefill*"] and lines[3].split()[:2] == ["w-2", "both"]
    assert lines[-1].startswith("* role assigned by the router")


def test_status_shows_the_processes_of_its_pdserve_up_with_their_restarts(
    tmp_path: pytest.TempPathFactory,
) -> None:
    import dataclasses
    import json
    from pathlib import Path

    from pdserve.cli.status import read_processes

    state = Path(str(tmp_path)) / "up.json"
    children = [
        {"name": "router-0", "kind": "router", "state": "running", "pid": 10, "url": "http://r",
         "num_restarts": 0, "last_exit": None, "reason": None, "pids": [10]},
        {"name": "decode-1", "kind": "worker", "state": "given_up", "pid": None, "url": "http://d",
         "num_restarts": 5, "last_exit": "exit code 1",
         "reason": "exited 6 times within 60 s (last: exit code 1): a crash loop, not restarted",
         "pids": [11, 12]},
    ]  # fmt: skip
    state.write_text(json.dumps({"router_urls": ["http://r/"], "children": children}))
    assert read_processes("http://other", state) == ()
    processes = read_processes("http://r", state)
    assert [(p.name, p.num_restarts, p.pids) for p in processes] == [
        ("router-0", 0, (10,)),
        ("decode-1", 5, (11, 12)),
    ]
    status = dataclasses.replace(
        ClusterStatus("http://r", 7, "ok", "disagg", "tiny", _rows()), processes=processes
    )
    lines = render_table(status).splitlines()
    assert lines[-2].split()[:5] == ["router-0", "router", "running", "10", "0"]
    assert lines[-1].split()[:5] == ["decode-1", "worker", "given_up", "-", "5"]
    assert lines[-1].endswith("a crash loop, not restarted")
