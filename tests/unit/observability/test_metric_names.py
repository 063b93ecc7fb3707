"""Every exported metric is declared once in `metric_names`, with its unit in the name, and
the router and worker render nothing else."""

from __future__ import annotations

from collections import Counter

from pdserve.engine.outputs import EngineStats
from pdserve.observability import metric_names as m
from pdserve.observability.exposition import parse
from pdserve.observability.request_stats import RequestStats
from pdserve.router.metrics import RouterMetrics, WorkerGauges
from pdserve.worker.metrics import SendHistograms, WorkerCounters, render

UNITS = ("_seconds", "_bytes", "_gigabytes_per_second")


def test_names_are_unique_and_carry_their_unit() -> None:
    names = [spec.name for spec in m.ALL]
    assert len(names) == len(set(names)) and len(names) >= 40
    for spec in m.ALL:
        assert spec.name.startswith(("pdserve_router_", "pdserve_worker_")), spec.name
        if spec.kind == "counter":
            assert spec.name.endswith("_total"), spec.name
        if spec.kind == "histogram":
            assert spec.name.endswith(UNITS), spec.name
    assert "pdserve_router_ttft_seconds_bucket" in m.SERIES
    assert "pdserve_router_ttft_seconds" not in m.SERIES  # a histogram has no bare series


def _router_text() -> str:
    metrics = RouterMetrics(
        workers=lambda: [
            WorkerGauges("http://w:1", "decode", True, 10, 2, 1, 0, 3, 1e-6),
            WorkerGauges("http://w:2", "unknown", False, None, None, None, None, 0, None),
        ]
    )
    metrics.count_request("disagg", "ok")
    metrics.observe_itl(0.01, 3)
    metrics.observe_request(
        RequestStats(0.1, 0.5, 0.02, 0.01, {"prefill": 0.05, "transfer": 0.01, "handoff": 0.03},
                     ("reprefill", "migration"), ("local_prefill",), 1)
    )  # fmt: skip
    metrics.kv_handoffs["ok"] += 1
    return metrics.render()


def _worker_text() -> str:
    stats = EngineStats(64, 50, 3, 4, 1, 2, 1, 0, 0)
    sends = SendHistograms()
    sends.observe(0.002, 1_000_000)
    counters = WorkerCounters(
        transfers_sent=1,
        kv_send_retries=1,
        refusals_by_reason={"FingerprintMismatch": 2, "ChecksumMismatch": 1},
        lease_expiries_by_kind={"reservation": 1},
        num_reserved_blocks=4,
    )
    return render("d-1", stats, 2, counters, sends)


def test_router_and_worker_render_only_declared_series() -> None:
    for text in (_router_text(), _worker_text()):
        samples = parse(text)
        assert samples
        assert {s.name for s in samples} <= m.SERIES
        declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
        assert declared <= m.NAMES


def test_router_values_follow_the_observations() -> None:
    samples = {(s.name, s.labels): s.value for s in parse(_router_text())}
    assert samples[("pdserve_router_itl_seconds_count", ())] == 3
    assert samples[("pdserve_router_ttft_seconds_sum", ())] == 0.1
    assert samples[("pdserve_router_handoff_gap_seconds_sum", ())] == 0.03
    assert samples[("pdserve_router_retries_total", (("reason", "reprefill"),))] == 1
    assert samples[("pdserve_router_fallbacks_total", (("reason", "local_prefill"),))] == 1
    assert samples[("pdserve_router_migrations_total", ())] == 1
    up = (("role", "unknown"), ("worker", "http://w:2"))  # the library sorts label names
    assert samples[("pdserve_router_worker_up", up)] == 0
    # A worker never polled has no block gauge rather than a made-up 0.
    assert ("pdserve_router_worker_blocks_free", up) not in samples


def test_worker_skew_refusals_are_the_fingerprint_and_version_refusals() -> None:
    samples = parse(_worker_text())
    by = Counter({(s.name, s.label("reason")): s.value for s in samples})
    assert by[("pdserve_worker_skew_refusals_total", "fingerprint")] == 2
    assert ("pdserve_worker_skew_refusals_total", "ChecksumMismatch") not in by
    assert by[("pdserve_worker_transfer_refusals_total", "ChecksumMismatch")] == 1
    assert by[("pdserve_worker_blocks_reserved", None)] == 4
    assert by[("pdserve_worker_kv_send_gigabytes_per_second_sum", None)] == 0.5
