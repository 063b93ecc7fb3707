"""`pdserve chaos` end to end: every fault scenario against real local clusters, real kills.

One module-scoped run (a reference cluster, then a fresh cluster per scenario, two at a time;
processes stopped by PID) and one test per scenario asserting what a user would see: every request
completes with exactly the fault-free tokens (none lost, none repeated), no block stays pinned
one lease TTL later, nothing runs past its deadline, and the scenario's own facts (a worker
killed, the skewed worker never paired, the breaker cycling). Extra latency is measured and
bounded loosely here: one second of difference on a shared 2-core machine is noise; the strict
bound is `pdserve chaos`'s own verdict.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pdlab.chaos.run import ChaosConfig, render_table, run_chaos_async
from pdlab.chaos.scenarios import BREAKER_CYCLE, SCENARIOS, ScenarioResult

pytestmark = pytest.mark.slow

# Far above any recovery that works (a re-prefill, a resend, a migration: ~1 s here), far
# below the waits of one that does not (the 30 s request deadline, stream silence timeouts).
LOOSE_EXTRA_LATENCY_S = 10.0


@pytest.fixture(scope="module")
def results(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, ScenarioResult]:
    workdir = tmp_path_factory.mktemp("chaos")
    # Two scenarios at a time (each on its own cluster): most of a scenario is waiting, and
    # the latency bound here is loose anyway.
    config = ChaosConfig(
        scenarios=SCENARIOS,
        model=str(tiny_model_path),
        workdir=workdir,
        strict_latency=False,
        concurrency=2,
    )
    found = asyncio.run(run_chaos_async(config))
    print(render_table(found))  # shown with -s, and in the failure report
    return {r.scenario: r for r in found}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [s.name for s in SCENARIOS])
def test_scenario_meets_every_target(results: dict[str, ScenarioResult], name: str) -> None:
    r = results[name]
    assert r.failures == [], render_table([r])
    assert r.num_sent >= 4
    assert (r.num_divergent, r.num_tokens_lost, r.num_tokens_duplicated) == (0, 0, 0)
    assert r.num_leaked_blocks == 0
    # Every worker alive at the end was checked (a killed one frees everything by dying).
    assert set(r.pinned_after_ttl) == set(r.pinned_idle) - set(r.dead_workers)
    assert r.num_past_deadline == 0
    if name == "router_dies_mid_handoff":
        assert r.num_completed == 0 and r.facts == {"router_alive": False}
        return
    assert r.num_completed == r.num_sent
    if r.latency_judged:
        assert r.extra_latency_p99_s <= LOOSE_EXTRA_LATENCY_S


def test_kills_hit_the_workers_they_name(results: dict[str, ScenarioResult]) -> None:
    assert results["kill_decode_mid_transfer"].dead_workers == ["decode-0"]
    assert results["kill_prefill_mid_prefill"].dead_workers == ["prefill-0"]
    killed = results["kill_decode_mid_decode"]
    assert killed.dead_workers == [killed.facts["killed"]]
    assert killed.facts["killed"] in ("decode-0", "decode-1")


def test_damaged_transfers_were_injected_and_resent(results: dict[str, ScenarioResult]) -> None:
    for name, action in (
        ("corrupt_chunk", "corrupt"),
        ("truncate_transfer", "truncate"),
        ("stall_link", "stall"),
    ):
        injected = results[name].injected
        assert injected and all("transfer.send#" in i and i.endswith(action) for i in injected)


def test_skewed_worker_is_named_in_health_and_never_used(
    results: dict[str, ScenarioResult],
) -> None:
    facts = results["version_skew"].facts
    assert facts["num_routed_to_unused"] == 0
    (problem,) = facts["health_problems"]  # type: ignore[misc]
    assert "cannot pair" in problem and "quantization 'int8' != 'none'" in problem


def test_full_decode_queues_and_never_prefills_first(results: dict[str, ScenarioResult]) -> None:
    facts = results["decode_full"].facts
    assert isinstance(facts["num_queued"], int) and facts["num_queued"] >= 1
    assert facts["num_wasted_prefills"] == 0


def test_flapping_path_opens_and_closes_the_breaker(results: dict[str, ScenarioResult]) -> None:
    transitions = results["flapping_kv_path"].facts["breaker_transitions"]
    assert isinstance(transitions, list) and set(BREAKER_CYCLE) <= set(transitions)
