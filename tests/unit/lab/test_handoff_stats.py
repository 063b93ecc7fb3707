"""Handoff overhead arithmetic: paired differences, medians, the transfer-time bound."""

from __future__ import annotations

import pytest

from pdlab.bench.handoff_stats import SLACK_S, RequestTiming, render, summarize, summary_json


def disagg(ttft: float, second: float, transfer: float = 0.040) -> RequestTiming:
    return RequestTiming(ttft, second, transfer, 32 << 20, "nixl")


def test_overhead_is_the_median_of_the_paired_differences() -> None:
    d = [disagg(0.310, 0.400), disagg(0.520, 0.610), disagg(0.290, 0.390)]
    c = [RequestTiming(0.300, 0.330), RequestTiming(0.500, 0.530), RequestTiming(0.300, 0.330)]
    out = summarize(d, c)
    # TTFT differences 10, 20, -10 ms: median 10 ms (not the 0 ms of median minus median:
    # 310 - 300); second token: 70, 80, 60 ms.
    assert out.ttft_overhead_s == pytest.approx(0.010)
    assert out.ttft_disagg_s == pytest.approx(0.310) and out.ttft_colocated_s == pytest.approx(
        0.300
    )
    assert out.second_token_overhead_s == pytest.approx(0.070)
    assert (out.ttft_overhead_q1_s, out.ttft_overhead_q3_s) == pytest.approx((0.0, 0.015))
    assert out.transfer_s == pytest.approx(0.040) and out.transports == ("nixl",)
    assert out.bound_s == pytest.approx(0.040 + SLACK_S) and out.met


def test_an_overhead_beyond_transfer_plus_slack_misses_the_target() -> None:
    out = summarize([disagg(0.400, 0.500, transfer=0.020)], [RequestTiming(0.350, 0.380)])
    assert out.ttft_overhead_s == pytest.approx(0.050)
    assert not out.met
    assert summary_json(out)["met"] is False
    assert "MISSED" in render(out)


def test_pairs_must_match_and_every_handoff_needs_its_transfer_time() -> None:
    with pytest.raises(ValueError, match="as many"):
        summarize([disagg(0.3, 0.4)], [])
    with pytest.raises(ValueError, match="transfer time"):
        summarize([RequestTiming(0.3, 0.4)], [RequestTiming(0.3, 0.4)])


def test_overhead_without_compute_removes_the_prefill_time_of_each_request() -> None:
    # The disaggregated prefill ran 30 ms slower than the colocated one (noise): the plain TTFT
    # overhead shows 36 ms, what the path adds around the compute is 6 ms.
    d = [RequestTiming(0.336, 0.40, 0.04, 1, "shm", worker_ttft_s=0.330)]
    c = [RequestTiming(0.300, 0.33, worker_ttft_s=0.300)]
    out = summarize(d, c)
    assert out.ttft_overhead_s == pytest.approx(0.036)
    assert out.ttft_overhead_excl_compute_s == pytest.approx(0.006)
    assert "6.0 ms" in render(out)
    missing = summarize([disagg(0.3, 0.4)], [RequestTiming(0.3, 0.4)])
    assert missing.ttft_overhead_excl_compute_s is None
