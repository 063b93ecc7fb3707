"""Which token gaps are decode TPOT samples, how requests end against the SLOs, and what the
live window summarises. Pure: steps and times are given."""

from __future__ import annotations

import math

import pytest

from pdserve.clock import FakeClock
from pdserve.errors import ConfigError
from pdserve.observability.exposition import parse, render_text, total
from pdserve.observability.request_stats import RequestStats
from pdserve.protocol.worker_api import StepInfo
from pdserve.router.mode.interference import (
    DecodeTracker,
    InterferenceWindow,
    SLOConfig,
    SLOOutcome,
    slo_outcome,
)
from pdserve.router.mode.live_monitor import LiveMonitor

SLO = SLOConfig(ttft_s=1.0, tpot_s=0.010)


def step(decode: bool = True, prefill: int = 0, index: int = 0) -> StepInfo:
    return StepInfo(
        index=index, duration_s=0.002, num_prefill_tokens=prefill, num_decode_tokens=1,
        decode=decode,
    )  # fmt: skip


def test_only_gaps_between_two_stream_tokens_of_decode_slices_are_samples() -> None:
    colocated = DecodeTracker()
    # The first token (its own prefill) has no gap; the next ones are decode samples.
    assert not colocated.classify(step(decode=False, prefill=30), None)
    assert colocated.classify(step(), 0.003)
    assert colocated.classify(step(prefill=500), 0.090)
    assert colocated.num_with_prefill == 1
    disagg = DecodeTracker()
    # The prefill worker's first token comes without a step: the next gap is the handoff.
    assert not disagg.classify(None, None)
    assert not disagg.classify(step(), 0.040)
    assert disagg.classify(step(), 0.003)
    migrated = DecodeTracker()
    assert migrated.classify(step(), 0.003) is False  # nothing before it on this tracker
    assert migrated.classify(step(), 0.003)
    # A resumed stream's first chunk recomputes (not a decode slice), whatever came before.
    assert not migrated.classify(step(decode=False, prefill=40), 0.200)
    assert migrated.num_with_prefill == 0


@pytest.mark.parametrize(
    ("ttft", "tpot", "finished", "outcome"),
    [
        (0.5, 0.005, True, SLOOutcome.MET),
        (0.5, None, True, SLOOutcome.MET),
        (1.5, 0.005, True, SLOOutcome.MISSED_TTFT),
        (0.5, 0.050, True, SLOOutcome.MISSED_TPOT),
        (1.5, 0.050, True, SLOOutcome.MISSED_BOTH),
        (0.5, 0.005, False, SLOOutcome.FAILED),
        (None, None, True, SLOOutcome.FAILED),
    ],
)
def test_slo_outcome(
    ttft: float | None, tpot: float | None, finished: bool, outcome: SLOOutcome
) -> None:
    assert slo_outcome(ttft, tpot, finished, SLO) is outcome


@pytest.mark.parametrize(("ttft", "tpot"), [(0.0, 0.01), (1.0, -1.0), (math.nan, 1.0), (1e9, 1.0)])
def test_out_of_range_slos_are_refused_naming_the_flag(ttft: float, tpot: float) -> None:
    with pytest.raises(ConfigError, match=r"--slo-(ttft|tpot)-ms"):
        SLOConfig(ttft, tpot)


def test_the_window_summarises_its_last_seconds_and_what_came_since_a_change() -> None:
    window = InterferenceWindow(SLO, window_s=10.0)
    empty = window.figures(0.0)
    assert empty.num_requests == 0 and math.isnan(empty.attainment)
    assert math.isnan(empty.mixed_fraction) and empty.with_prefill.num_tokens == 0
    window.add_arrival(1.0, 1000, 8)  # falls out of the window below
    window.add_decode_token(1.0, 0.5, True)
    for t in range(5, 15):
        window.add_arrival(float(t), 100, 10)
        window.add_decode_token(float(t), 0.002 + t / 1000, False)
    window.add_decode_token(12.0, 0.090, True)
    window.add_decode_token(13.0, 0.110, True)
    window.add_request(11.0, SLOOutcome.MET, 0.004)
    window.add_request(12.0, SLOOutcome.MISSED_TPOT, 0.030, interfered=True)
    window.add_request(13.0, SLOOutcome.MISSED_TPOT, 0.012, interfered=False)
    window.add_request(14.0, SLOOutcome.MISSED_TTFT, 0.004)
    f = window.figures(15.0)
    assert f.window_s == 10.0
    assert f.without_prefill.num_tokens == 10
    assert f.without_prefill.mean_s == pytest.approx(0.0115)
    assert (f.with_prefill.num_tokens, f.with_prefill.p90_s) == (2, 0.110)
    assert f.mixed_fraction == pytest.approx(2 / 12)
    assert (f.num_requests, f.attainment, f.ttft_attainment, f.tpot_attainment) == (
        4,
        0.25,
        0.75,
        0.5,
    )
    assert (f.num_tpot_missed, f.num_tpot_missed_interfered) == (2, 1)
    assert f.request_tpot_p90_s == 0.030
    assert (f.arrival_rate, f.prompt_tokens_per_s, f.output_tokens_per_s) == (1.0, 100.0, 10.0)
    since = window.figures(15.0, since_s=12.5)
    assert since.window_s == 2.5 and since.num_requests == 2
    assert since.with_prefill.num_tokens == 1 and since.without_prefill.num_tokens == 2
    assert since.arrival_rate == pytest.approx(2 / 2.5)


def test_a_layout_is_judged_by_the_requests_that_began_under_it() -> None:
    # A colocated request that crossed a split ends after it with the interference the split
    # removes: it must not count against the split (nor, unknown start, be dropped).
    window = InterferenceWindow(SLO, window_s=10.0)
    window.add_request(21.0, SLOOutcome.MISSED_TPOT, 0.2, interfered=True, began_s=19.0)
    window.add_request(21.5, SLOOutcome.MET, 0.004, began_s=20.5)
    window.add_request(22.0, SLOOutcome.MET, 0.004)
    since = window.figures(22.0, since_s=20.0)
    assert (since.num_requests, since.tpot_attainment) == (2, 1.0)
    whole = window.figures(22.0)
    assert (whole.num_requests, whole.num_tpot_missed) == (3, 1)


def test_the_live_monitor_renders_labelled_histograms_outcomes_and_window_gauges() -> None:
    clock = FakeClock(100.0)
    monitor = LiveMonitor(SLO, window_s=10.0, clock=clock)
    tracker = monitor.begin(1000, 4)
    monitor.chunk(tracker, step(decode=False, prefill=1000), None, 1)
    clock.advance(0.003)
    monitor.chunk(tracker, step(), 0.003, 1)
    clock.advance(0.2)
    monitor.chunk(tracker, step(prefill=800), 0.2, 1)
    stats = RequestStats(ttft_s=0.1, e2e_s=0.3, tpot_s=0.1, queue_s=None)
    assert monitor.end(tracker, stats, finished=True) is SLOOutcome.MISSED_TPOT
    samples = parse(render_text(monitor.render()))
    tpot = "pdserve_router_decode_tpot_seconds"
    assert total(samples, f"{tpot}_count", prefill="with") == 1
    assert total(samples, f"{tpot}_sum", prefill="without") == pytest.approx(0.003)
    assert total(samples, "pdserve_router_decode_step_seconds_count", prefill="with") == 1
    assert total(samples, "pdserve_router_slo_requests_total", outcome="missed_tpot") == 1
    assert total(samples, "pdserve_router_slo_requests_total", outcome="met") == 0
    assert total(samples, "pdserve_router_slo_attainment", slo="tpot") == 0.0
    assert total(samples, "pdserve_router_slo_attainment", slo="ttft") == 1.0
    assert total(samples, "pdserve_router_slo_target_seconds", slo="tpot") == 0.010
    figures = monitor.figures()
    assert (figures.num_tpot_missed, figures.num_tpot_missed_interfered) == (1, 1)
    clock.advance(11.0)
    # Past the window: no request, so no attainment sample at all (not a NaN).
    later = parse(render_text(monitor.render()))
    assert not [s for s in later if s.name == "pdserve_router_slo_attainment"]
