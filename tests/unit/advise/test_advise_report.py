"""`pdserve advise` without a cluster: flags and trace lines refused before anything starts,
the workload's seeded requests, and what the advice concludes from curves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.advise.command import AdviseConfig, build_parser, config_from_args, report_json
from pdserve.advise.goodput_stats import SLO, RateSummary, WorkloadShape
from pdserve.advise.report import Arm, advise, arms_for, render_advice, sustained_rate
from pdserve.advise.workload import (
    AdviseWorkload,
    TraceRequest,
    parse_range,
    parse_trace,
    respell,
)
from pdserve.cli import main
from pdserve.errors import ConfigError


@pytest.fixture(autouse=True)
def _tiny_cache(tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The default model's context is read (not built again) from the session's cache.
    monkeypatch.setenv("PDSERVE_CACHE", str(tiny_model_path.parent))


def parse(*flags: str) -> AdviseConfig:
    return config_from_args(build_parser().parse_args(flags))


def test_flags_reach_the_config() -> None:
    c = parse(
        "--workers", "3", "--slo-ttft-ms", "800", "--slo-tpot-ms", "12", "--rates", "1,3",
        "--prompt-tokens", "900-1200", "--output-tokens", "8", "--num-requests", "20",
        "--target-attainment", "0.95", "--max-num-batched-tokens", "512",
    )  # fmt: skip
    assert (c.num_workers, c.slo, c.rates) == (3, SLO(0.8, 0.012), (1.0, 3.0))
    assert c.workload.shape == WorkloadShape(900, 1200, 8, 8)
    assert (c.num_requests, c.duration_s, c.target_attainment) == (20, None, 0.95)
    assert c.max_num_batched_tokens == 512


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--workers", "1"], "--workers"),
        (["--workers", "99"], "--workers"),
        (["--slo-ttft-ms", "0"], "--slo-ttft-ms"),
        (["--slo-tpot-ms", "-3"], "--slo-tpot-ms"),
        (["--slo-tpot-ms", "1e12"], "--slo-tpot-ms"),
        (["--rates", "1,x"], "--rates"),
        (["--rates", "5000"], "--rates"),
        (["--rates", "2,2"], "--rates"),
        (["--duration-s", "0"], "--duration-s"),
        (["--num-requests", "5", "--duration-s", "3"], "--num-requests"),
        (["--target-attainment", "1.2"], "--target-attainment"),
        (["--prompt-tokens", "0-10"], "--prompt-tokens"),
        (["--prompt-tokens", "20-10"], "--prompt-tokens"),
        (["--prompt-tokens", "1-2-3"], "--prompt-tokens"),
        (["--output-tokens", "9000"], "--output-tokens"),
        (["--prompt-tokens", "2000", "--output-tokens", "100"], "--output-tokens"),
        (["--workload", "x.jsonl", "--prompt-tokens", "10"], "--prompt-tokens"),
        (["--workload", "/nonexistent/trace.jsonl"], "--workload"),
        (["--model", "/nonexistent/model"], "--model"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    ],
)
def test_a_bad_flag_exits_2_naming_it_before_anything_starts(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # main() would start a cluster after the checks: exit 2 proves none was started.
    assert main(["advise", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve advise: error: ") and named in err


def test_a_malformed_trace_line_is_refused_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"prompt_tokens": 10, "output_tokens": 4}\n\n# a comment\n{"prompt_tokens": 3}\n'
    )
    assert main(["advise", "--workload", str(trace)]) == 2
    assert f"--workload {trace} line 4: missing output_tokens" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("not json", "line 1: not JSON"),
        ("[1, 2]", "line 1: expected an object"),
        ('{"prompt_tokens": 1, "output_tokens": 2, "x": 3}', "line 1: unknown field 'x'"),
        (
            '{"prompt_tokens": 0, "output_tokens": 2}',
            "line 1: prompt_tokens must be an integer >= 1",
        ),
        ('{"prompt_tokens": 1.5, "output_tokens": 2}', "prompt_tokens must be an integer"),
        ('{"prompt_tokens": true, "output_tokens": 2}', "prompt_tokens must be an integer"),
        ('{"prompt_tokens": 100, "output_tokens": 200}', "exceed the model's context of 256"),
    ],
)
def test_trace_lines(line: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        parse_trace(line, max_model_len=256, source="t")
    with pytest.raises(ConfigError, match="no request"):
        parse_trace("\n# only a comment\n", 256)


@given(st.text(max_size=300))
def test_any_trace_text_parses_or_is_refused_with_a_config_error(text: str) -> None:
    try:
        requests = parse_trace(text, max_model_len=4096)
    except ConfigError as exc:
        assert str(exc).startswith("--workload")
    else:
        assert all(r.num_prompt_tokens >= 1 and r.num_output_tokens >= 1 for r in requests)


@given(st.text(max_size=20))
def test_any_range_text_parses_or_is_refused_naming_the_flag(text: str) -> None:
    try:
        low, high = parse_range("--prompt-tokens", text, 100)
    except ConfigError as exc:
        assert str(exc).startswith("--prompt-tokens: ")
    else:
        assert 1 <= low <= high <= 100


def test_a_trace_workload_draws_lengths_from_its_lines_and_respelling_keeps_them() -> None:
    trace = (TraceRequest(50, 4), TraceRequest(300, 16))
    workload = AdviseWorkload(trace=trace)
    specs = workload.build(4.0, seed=1, num_requests=40, duration_s=None)
    assert specs == workload.build(4.0, seed=1, num_requests=40, duration_s=None)
    sizes = {(len(s.prompt_token_ids), s.max_tokens) for s in specs}
    assert sizes == {(50, 4), (300, 16)}
    other = respell(specs, seed=7)
    assert [(s.arrival_s, len(s.prompt_token_ids), s.max_tokens) for s in other] == [
        (s.arrival_s, len(s.prompt_token_ids), s.max_tokens) for s in specs
    ]
    assert all(a.prompt_token_ids != b.prompt_token_ids for a, b in zip(specs, other, strict=True))
    assert workload.describe()["mean_prompt_tokens"] == 175
    with pytest.raises(ConfigError):
        AdviseWorkload()


def test_arms_are_colocated_then_every_split() -> None:
    assert [a.name for a in arms_for(3)] == ["colocated", "disagg-1:2", "disagg-2:1"]
    assert arms_for(2)[1] == Arm(1, 1)


def _summary(mode: str, rate: float, attainment: float, goodput: float) -> RateSummary:
    nan = float("nan")
    return RateSummary(mode, rate, 10, 0, int(attainment * 10), 5.0, goodput, 0.0, attainment,
                       goodput, nan, nan, nan, nan, nan, nan)  # fmt: skip


def test_sustained_rate_stops_at_the_first_rate_that_misses() -> None:
    rows = [_summary("a", 1, 1.0, 1), _summary("a", 2, 0.8, 1.6), _summary("a", 4, 0.95, 3.8)]
    assert sustained_rate(rows, 0.9) == 1
    assert sustained_rate(rows, 0.5) == 4
    assert sustained_rate([_summary("a", 1, 0.2, 0.2)], 0.9) == 0


def test_the_advice_picks_the_arm_that_sustains_most_colocated_on_a_tie() -> None:
    arms = arms_for(2)
    split_wins = [
        _summary("colocated", 2, 1.0, 2.0), _summary("colocated", 4, 0.6, 2.4),
        _summary("disagg-1:1", 2, 1.0, 2.0), _summary("disagg-1:1", 4, 0.95, 3.8),
    ]  # fmt: skip
    advice = advise(arms, split_wins, 0.9)
    assert advice.arm.name == "disagg-1:1" and advice.meets_slo
    assert advice.sustained == {"colocated": 2, "disagg-1:1": 4}
    assert advice.ratio_by_rate == {2: 1.0, 4: pytest.approx(3.8 / 2.4)}
    text = render_advice(advice, SLO(1.0, 0.02), 0.9)
    assert text.splitlines()[0] == (
        "recommendation: disagg-1:1 (1 prefill + 1 decode workers): sustains 4 req/s with >= 90%"
        " of requests within TTFT <= 1000 ms and TPOT <= 20 ms"
    )
    assert "goodput at 4 req/s: best split / colocated = 1.58x" in text
    tie = [_summary("colocated", 2, 1.0, 2.0), _summary("disagg-1:1", 2, 1.0, 2.0)]
    assert advise(arms, tie, 0.9).arm.name == "colocated"
    none = [_summary("colocated", 2, 0.3, 0.6), _summary("disagg-1:1", 2, 0.5, 1.0)]
    missed = advise(arms, none, 0.9)
    assert (missed.arm.name, missed.meets_slo) == ("disagg-1:1", False)
    assert "Add workers or loosen the SLOs" in render_advice(missed, SLO(1.0, 0.02), 0.9)
    coloc_zero = advise(arms, [*none[:1], _summary("colocated", 4, 0.0, 0.0)], 0.9)
    assert coloc_zero.ratio_by_rate[4] is None


def test_the_json_carries_the_ratio_and_the_recommendation() -> None:
    from pdserve.advise.command import AdviseResult
    from pdserve.advise.goodput import ServeReport

    arms = arms_for(2)
    rows = [_summary("colocated", 2.0, 0.6, 1.2), _summary("disagg-1:1", 2.0, 1.0, 2.0)]
    config = AdviseConfig(workload=AdviseWorkload(shape=WorkloadShape()), rates=(2.0,))
    result = AdviseResult(config, arms, ServeReport(summaries=rows), advise(arms, rows, 0.9))
    doc = json.loads(json.dumps(report_json(result)))
    assert doc["config"]["calibration"] is None
    assert doc["goodput_ratio_disagg_vs_colocated"] == {"2.0": pytest.approx(2.0 / 1.2)}
    assert doc["recommendation"]["name"] == "disagg-1:1" and doc["recommendation"]["meets_slo"]
    assert doc["goodput_ratio_vs_colocated"] == {"disagg-1:1": {"2.0": pytest.approx(2.0 / 1.2)}}
    assert doc["config"]["workload"]["source"] == "synthetic"
