"""The serve benchmark's arithmetic: arrivals, TPOT, SLO attainment, goodput, ratios, CDFs."""

from __future__ import annotations

import math
import random

import pytest

from pdserve.advise.goodput_stats import (
    SLO,
    VOCAB,
    RequestRecord,
    WorkloadShape,
    build_workload,
    cdf,
    goodput_ratios,
    poisson_arrivals,
    render_table,
    representative,
    summarize,
)
from pdserve.errors import ConfigError


class _Gaps(random.Random):
    """A Random whose exponential draws are a fixed list of gaps (and their rate recorded)."""

    def __init__(self, gaps: list[float]) -> None:
        super().__init__(0)
        self.gaps = list(gaps)
        self.rates: list[float] = []

    def expovariate(self, lambd: float = 1.0) -> float:
        self.rates.append(lambd)
        return self.gaps.pop(0)


def rec(
    index: int, ttft: float | None, e2e: float, tokens: int, error: str | None = None
) -> RequestRecord:
    return RequestRecord(index, 100, tokens, ttft, e2e, error, f"cmpl-{index}")


# Binary fractions throughout, so "at the SLO" is exact in floating point.
SLO_1 = SLO(ttft_s=0.25, tpot_s=0.0625)


def test_arrivals_are_running_sums_of_gaps_at_the_rate() -> None:
    rng = _Gaps([0.5, 0.25, 1.0, 9.0])
    assert poisson_arrivals(4.0, rng, 3, None) == [0.5, 0.75, 1.75]
    assert rng.rates == [4.0, 4.0, 4.0]


def test_arrivals_by_duration_stop_before_it_but_keep_at_least_one() -> None:
    assert poisson_arrivals(2.0, _Gaps([0.5, 0.25, 1.0, 9.0]), None, 1.75) == [0.5, 0.75]
    # The first arrival already past the duration: one request, never an empty run.
    assert poisson_arrivals(2.0, _Gaps([3.0, 1.0]), None, 1.0) == [3.0]


@pytest.mark.parametrize(
    ("rate", "num", "duration"), [(0.0, 3, None), (-1.0, 3, None), (1.0, None, None), (1, 3, 2.0)]
)
def test_arrivals_need_a_positive_rate_and_exactly_one_bound(
    rate: float, num: int | None, duration: float | None
) -> None:
    with pytest.raises(ConfigError):
        poisson_arrivals(rate, random.Random(0), num, duration)


def test_seeded_poisson_mean_gap_is_one_over_rate() -> None:
    arrivals = poisson_arrivals(8.0, random.Random(3), 4000, None)
    assert arrivals == sorted(arrivals)
    assert arrivals[-1] / len(arrivals) == pytest.approx(1 / 8, rel=0.05)


def test_workload_is_seeded_and_within_its_shape() -> None:
    shape = WorkloadShape(min_prompt_tokens=4, max_prompt_tokens=9, min_output_tokens=2)
    a = build_workload(5.0, 7, shape, num_requests=50)
    assert a == build_workload(5.0, 7, shape, num_requests=50)
    assert a != build_workload(5.0, 8, shape, num_requests=50)
    assert [s.index for s in a] == list(range(50))
    assert {len(s.prompt_token_ids) for s in a} == set(range(4, 10))
    assert all(2 <= s.max_tokens <= 64 for s in a)
    assert all(VOCAB[0] <= t < VOCAB[1] for s in a for t in s.prompt_token_ids)
    # Arrivals come from the same stream first: they match a bare Poisson draw of the seed.
    assert [s.arrival_s for s in a] == poisson_arrivals(5.0, random.Random(7), 50, None)


def test_shape_and_slo_refuse_empty_ranges_and_non_positive_targets() -> None:
    with pytest.raises(ConfigError, match="prompt tokens"):
        WorkloadShape(min_prompt_tokens=10, max_prompt_tokens=9)
    with pytest.raises(ConfigError, match="output tokens"):
        WorkloadShape(min_output_tokens=0)
    with pytest.raises(ConfigError, match="SLOs"):
        SLO(ttft_s=0.1, tpot_s=0.0)


def test_tpot_excludes_the_first_token() -> None:
    assert rec(0, 0.125, 0.625, 5).tpot_s == 0.125
    assert rec(0, 0.1, 0.1, 1).tpot_s is None
    assert rec(0, 0.1, 0.5, 5, "boom").tpot_s is None
    assert rec(0, None, 0.5, 0).tpot_s is None


def test_meeting_the_slos_needs_both_and_no_error() -> None:
    assert rec(0, 0.25, 0.5, 5).meets(SLO_1)  # TTFT and TPOT exactly at their SLOs
    assert not rec(0, 0.3, 0.5, 5).meets(SLO_1)  # TTFT over
    assert not rec(0, 0.125, 0.5, 5).meets(SLO_1)  # TPOT 0.09375 over
    assert not rec(0, 0.1, 0.1, 5, "http_503").meets(SLO_1)
    assert not rec(0, None, 0.1, 0).meets(SLO_1)
    assert rec(0, 0.1, 0.1, 1).meets(SLO_1)  # one token: no TPOT to miss


def test_summary_counts_failures_as_misses_and_divides_by_the_span() -> None:
    records = [
        rec(0, 0.125, 0.375, 5),  # meets: TPOT 0.0625
        rec(1, 0.5, 0.75, 5),  # TTFT over
        rec(2, 0.0625, 0.5625, 5),  # TPOT 0.125 over
        rec(3, 0.25, 0.25, 1),  # meets
        rec(4, None, 1.0, 0, "connection_error: reset"),
    ]
    s = summarize("disagg", 2.0, records, span_s=2.0, slo=SLO_1)
    assert (s.mode, s.rate, s.num_requests, s.num_errors, s.num_meeting_slo) == (
        "disagg",
        2.0,
        5,
        1,
        2,
    )
    assert (s.attainment, s.goodput_rps, s.throughput_rps) == (2 / 5, 1.0, 2.0)
    assert s.output_tokens_per_s == 16 / 2
    # Nearest rank over completed requests: TTFT ms [62.5, 125, 250, 500].
    assert (s.ttft_p50_ms, s.ttft_p99_ms) == (125.0, 500.0)
    # TPOT ms over requests with >= 2 tokens: [62.5, 62.5, 125].
    assert (s.tpot_p50_ms, s.tpot_p99_ms) == (62.5, 125.0)
    assert (s.e2e_p50_ms, s.e2e_p99_ms) == (375.0, 750.0)


def test_summary_of_only_failures_has_no_latencies() -> None:
    s = summarize("colocated", 1.0, [rec(0, None, 1.0, 0, "x")], span_s=1.0, slo=SLO_1)
    assert (s.attainment, s.goodput_rps, s.throughput_rps) == (0.0, 0.0, 0.0)
    assert math.isnan(s.ttft_p50_ms) and math.isnan(s.tpot_p99_ms)


def test_goodput_ratio_per_rate_both_modes_ran() -> None:
    good = [rec(0, 0.1, 0.1, 1)]
    bad = [rec(0, 1.0, 1.0, 1)]
    summaries = [
        summarize("disagg", 1.0, good * 3, 1.0, SLO_1),
        summarize("colocated", 1.0, good * 2, 1.0, SLO_1),
        summarize("disagg", 2.0, good, 1.0, SLO_1),
        summarize("colocated", 2.0, bad, 1.0, SLO_1),
        summarize("disagg", 4.0, good, 1.0, SLO_1),
    ]
    assert goodput_ratios(summaries) == {1.0: pytest.approx(1.5), 2.0: None}


def test_cdf_steps_and_representative_is_the_median_completed_request() -> None:
    assert cdf([3.0, 1.0, math.nan, 2.0, 2.0]) == ([1.0, 2.0, 2.0, 3.0], [0.25, 0.5, 0.75, 1.0])
    records = [rec(0, 0.1, 0.4, 2), rec(1, 0.1, 0.2, 2), rec(2, 0.1, 0.3, 2)]
    records.append(rec(3, None, 0.05, 0, "x"))
    chosen = representative(records)
    assert chosen is not None and chosen.index == 2
    assert representative([rec(0, None, 1.0, 0, "x")]) is None


def test_table_has_one_row_per_mode_and_rate() -> None:
    s = summarize("disagg", 2.0, [rec(0, 0.125, 0.375, 5)], span_s=0.5, slo=SLO_1)
    rows = render_table([s], SLO_1).splitlines()
    assert len(rows) == 4
    expected = ["disagg", "2", "1", "0", "2.00", "2.00", "1.00", "125", "125", "62.5", "62.5"]
    assert rows[2].split() == expected
    assert "TTFT <= 250 ms and TPOT <= 62.5 ms" in rows[3]
