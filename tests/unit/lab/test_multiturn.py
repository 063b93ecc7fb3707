"""The multi-turn benchmark's arithmetic: hit rates, TTFT averages, the table's rows."""

from __future__ import annotations

import pytest

from pdlab.bench.multiturn import (
    MultiTurnConfig,
    RoutingResult,
    TurnResult,
    render_table,
    two_router_comparison,
)
from pdserve.errors import ConfigError


def turn(n: int, ttft: float, prompt: int, prefilled: int, reusable: int, seen: int) -> TurnResult:
    return TurnResult(
        turn=n,
        ttft_ms_mean=ttft,
        ttft_ms_max=ttft,
        num_prompt_tokens=prompt,
        num_prefilled_tokens=prefilled,
        num_reusable_tokens=reusable,
        num_seen_tokens=seen,
        kv_bytes=prefilled * 10,
        num_new_tokens=prompt - reusable,
    )


def test_hit_rates_skip_turn_one_and_count_reused_over_reusable() -> None:
    r = RoutingResult("x", [turn(1, 9.0, 100, 100, 0, 0), turn(2, 3.0, 148, 52, 96, 115)])
    r.turns.append(turn(3, 1.0, 196, 100, 144, 163))
    # Reused: (148 - 52) + (196 - 100) = 192; block-reusable 240; seen 278.
    assert r.hit_rate == pytest.approx(192 / 240)
    assert r.token_hit_rate == pytest.approx(192 / 278)
    assert r.ttft_ms_from(2) == pytest.approx(2.0)
    assert RoutingResult("empty", [turn(1, 1.0, 10, 10, 0, 0)]).hit_rate == 0.0


def test_table_has_one_row_per_turn_with_bytes_per_new_token() -> None:
    r = RoutingResult("affinity", [turn(1, 9.0, 100, 100, 0, 0), turn(2, 3.0, 148, 52, 96, 115)])
    rows = render_table([r]).splitlines()
    assert len(rows) == 2 + 2
    assert rows[3].split() == ["affinity", "2", "3.0", "52", "96", "520", "52", "10"]


def test_a_workload_too_small_to_report_is_refused_naming_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"--turns: must be >= 4, got 3"):
        MultiTurnConfig(num_turns=3)
    with pytest.raises(ConfigError, match=r"--chats: must be >= 1, got 0"):
        MultiTurnConfig(num_chats=0)
    with pytest.raises(ConfigError, match=r"--routing: 'nearest' is not one of"):
        MultiTurnConfig(routings=("nearest",))


def test_two_routers_are_compared_with_one_by_hit_rate_and_ttft_gain() -> None:
    def result(name: str, ttft: float, prefilled: int) -> RoutingResult:
        turns = [turn(1, 50.0, 100, 100, 0, 0)]
        turns += [turn(n, ttft, 148, prefilled, 96, 115) for n in range(2, 6)]
        return RoutingResult(name, turns)

    base, one = result("round_robin", 40.0, 148), result("affinity", 10.0, 52)
    close = two_router_comparison([base, one, result("affinity-2routers", 10.5, 55)])
    assert close["two_router_hit_rate_ratio"] == pytest.approx(93 / 96)
    assert close["two_router_ttft_gain_ratio"] == pytest.approx((40 / 10.5) / (40 / 10))
    assert close["two_router_within_10pct"] == 1.0
    far = two_router_comparison([base, one, result("affinity-2routers", 30.0, 148)])
    assert far["two_router_hit_rate_ratio"] == 0.0 and far["two_router_within_10pct"] == 0.0
    assert two_router_comparison([base, one]) == {}


def test_the_ttft_gain_uses_the_median_request_so_one_slow_turn_does_not_swing_it() -> None:
    def result(name: str, per_turn: list[list[float]]) -> RoutingResult:
        turns = [turn(1, 50.0, 100, 100, 0, 0)]
        for n, ttfts in enumerate(per_turn, start=2):
            t = turn(n, sum(ttfts) / len(ttfts), 148, 52, 96, 115)
            t.ttft_ms = ttfts
            turns.append(t)
        return RoutingResult(name, turns)

    base = result("round_robin", [[40.0] * 4] * 4)
    one = result("affinity", [[10.0] * 4] * 4)
    # Same typical request; one request of turn 4 stalled (a core taken by another job).
    two = result(
        "affinity-2routers", [[10.0] * 4, [10.0] * 4, [10.0, 10.0, 10.0, 130.0], [10.0] * 4]
    )
    assert two.ttft_ms_from(4) == pytest.approx(25.0)  # (40 + 10) / 2: 2.5x the typical
    assert two.ttft_ms_p50_from(4) == 10.0
    summary = two_router_comparison([base, one, two])
    assert summary["two_router_ttft_gain_ratio"] == pytest.approx(1.0)
    assert summary["two_router_ttft_gain_ratio_of_means"] == pytest.approx(0.4)
    assert summary["two_router_within_10pct"] == 1.0
