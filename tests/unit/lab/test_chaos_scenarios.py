"""The chaos scenarios' pure parts: token accounting, percentiles, and what `judge` calls a miss."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdlab.chaos.scenarios import (
    BREAKER_CYCLE,
    SCENARIOS,
    Outcome,
    Scenario,
    ScenarioResult,
    Trigger,
    find_scenarios,
    judge,
    lost_and_duplicated,
    measure_outputs,
    percentile,
)
from pdserve.errors import ConfigError
from pdserve.faults import parse_rule

REF = (Outcome(0, (5, 6, 7, 8), "length", None, 1.0), Outcome(1, (9, 9, 4), "length", None, 2.0))


def by_name(name: str) -> Scenario:
    (scenario,) = find_scenarios(name)
    return scenario


def test_lost_and_duplicated_count_a_skip_and_a_repeat_at_a_resume_point() -> None:
    assert lost_and_duplicated([1, 2, 3, 4], [1, 2, 3, 4]) == (0, 0)
    assert lost_and_duplicated([1, 2, 3, 4], [1, 2, 4]) == (1, 0)  # 3 skipped
    assert lost_and_duplicated([1, 2, 3, 4], [1, 2, 2, 3, 4]) == (0, 1)  # 2 sent twice
    assert lost_and_duplicated([1, 2, 3], [1, 2, 3, 3, 9]) == (0, 2)


@given(st.lists(st.integers(0, 5), max_size=20))
def test_a_sequence_against_itself_loses_and_repeats_nothing(tokens: list[int]) -> None:
    assert lost_and_duplicated(tokens, list(tokens)) == (0, 0)
    assert lost_and_duplicated(tokens, []) == (len(tokens), 0)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert percentile([4.0], 99) == 4.0
    assert math.isnan(percentile([], 50))


def test_measure_outputs_counts_divergence_failures_and_extra_latency() -> None:
    result = ScenarioResult("x", "")
    outcomes = [
        Outcome(0, (5, 6, 7, 8), "length", None, 1.5),  # same tokens, 0.5 s slower
        Outcome(1, (9, 9, 9, 4), "length", None, 2.0),  # one token repeated
        Outcome(0, (), None, "service_unavailable (503): no decode worker", 40.0),
    ]
    measure_outputs(result, REF, outcomes, deadline_s=30.0)
    assert (result.num_sent, result.num_completed, result.num_failed) == (3, 2, 1)
    assert result.errors == ["service_unavailable (503): no decode worker"]
    assert (result.num_divergent, result.num_tokens_lost, result.num_tokens_duplicated) == (1, 0, 1)
    assert result.num_past_deadline == 1
    assert result.extra_latency_p50_s == 0.0 and result.extra_latency_p99_s == 0.5


def _clean(n: int = 2) -> ScenarioResult:
    result = ScenarioResult("x", "", num_sent=n, num_completed=n)
    result.extra_latency_p99_s = 0.1
    result.latency_bound_s = 1.0
    return result


def test_a_clean_plan_run_passes_only_if_the_plan_fired() -> None:
    scenario = by_name("corrupt_chunk")
    result = _clean()
    assert judge(scenario, result) == ["the fault plan never fired"]
    result.injected = ["prefill-0: transfer.send#2 corrupt"]
    assert judge(scenario, result) == []


def test_judge_names_every_missed_target() -> None:
    scenario = by_name("kill_decode_mid_transfer")
    result = _clean(3)
    result.num_completed, result.num_failed, result.errors = 2, 1, ["bad_gateway (502): x"]
    result.num_divergent, result.num_tokens_lost = 1, 2
    result.num_leaked_blocks, result.pinned_idle, result.pinned_after_ttl = 3, {"p": 0}, {"p": 3}
    result.extra_latency_p99_s = 2.5
    missed = judge(scenario, result)
    assert missed == [
        "1 of 3 requests failed: ['bad_gateway (502): x']",
        "1 outputs differ from the fault-free reference",
        "2 tokens lost, 0 duplicated",
        "3 blocks still pinned one lease TTL after the run (idle {'p': 0}, after {'p': 3})",
        "decode-0 was to be killed by the fault but is alive",
        "the fault plan never fired",
        "extra latency p99 2.50 s is over the bound 1.00 s (one re-prefill + 1 s)",
    ]


def test_scenario_specific_facts_are_judged() -> None:
    skew, full, flap = by_name("version_skew"), by_name("decode_full"), by_name("flapping_kv_path")
    result = _clean()
    result.facts = {"num_routed_to_unused": 1, "health_names_skew": False, "health_problems": []}
    assert judge(skew, result) == [
        "1 requests were routed to ['decode-2'], whose fingerprint differs",
        "router health does not name the skew: []",
    ]
    result.facts = {"num_queued": 0, "num_wasted_prefills": 1}
    assert judge(full, result) == [
        "no request waited for a reservation (num_queued=0)",
        "1 prefills ran without a decode reservation",
    ]
    result.facts = {"breaker_transitions": ["closed->open"]}
    result.injected = ["prefill-0: transfer.send#0 close"]
    assert judge(flap, result) == [
        f"breaker transitions ['closed->open'], expected {list(BREAKER_CYCLE)}"
    ]
    result.facts = {"breaker_transitions": list(BREAKER_CYCLE)}
    assert judge(flap, result) == []


def test_a_dying_router_must_fail_requests_but_not_leak() -> None:
    scenario = by_name("router_dies_mid_handoff")
    result = _clean()
    assert judge(scenario, result) == ["the router was to die, yet every request completed"]
    result.num_completed, result.num_failed = 0, 2
    assert judge(scenario, result) == []


def test_every_scenario_plan_parses_and_names_its_workers() -> None:
    names = [s.name for s in SCENARIOS]
    assert len(set(names)) == len(names) == 11
    for scenario in SCENARIOS:
        workers = {w.name for w in scenario.workers}
        for name, rules in scenario.plans:
            assert name in workers, (scenario.name, name)
            for rule in rules:
                parse_rule(rule)
        assert set(scenario.expect_dead) <= workers and set(scenario.expect_unused) <= workers
        assert bool(scenario.plans) == (scenario.trigger in (Trigger.PLAN, Trigger.FLAP))


def test_find_scenarios_lists_the_names_on_a_typo() -> None:
    assert find_scenarios("all") == SCENARIOS
    with pytest.raises(ConfigError, match="'stall' is not one of all, kill_decode_mid_transfer"):
        find_scenarios("stall")
