"""`pdserve.faults`: rule syntax (good, bad, round trip), after/times/probability, seeded
determinism, and the control-path actions of `perform`."""

from __future__ import annotations

import asyncio
import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.errors import ConfigError
from pdserve.faults import (
    DEFAULT_DELAY_S,
    RECORD_LIMIT,
    FaultClosed,
    FaultInjector,
    FaultKind,
    FaultRule,
    FaultSite,
    Injection,
    allowed_actions,
    parse_rule,
    parse_rules,
    perform,
)

SEND = FaultSite.TRANSFER_SEND
TOKENS = FaultSite.WORKER_DECODE_TOKENS


# ---- parsing -------------------------------------------------------------------------------


def test_parse_rule_reads_site_action_and_options() -> None:
    assert parse_rule("transfer.send:corrupt:after=2") == FaultRule(SEND, FaultKind.CORRUPT, 2)
    assert parse_rule("worker.decode_tokens:crash:after=5") == FaultRule(
        TOKENS, FaultKind.CRASH, after=5
    )
    assert parse_rule("worker.prefill:delay:delay_s=2") == FaultRule(
        FaultSite.WORKER_PREFILL, FaultKind.DELAY, delay_s=2.0
    )
    assert parse_rule(" transfer.send:truncate:offset=7, times=0,probability=0.5 ") == FaultRule(
        SEND, FaultKind.TRUNCATE, times=0, probability=0.5, offset=7
    )
    assert parse_rules(["worker.reserve:stall", "router.after_prefill:close"]) == (
        FaultRule(FaultSite.WORKER_RESERVE, FaultKind.STALL),
        FaultRule(FaultSite.ROUTER_AFTER_PREFILL, FaultKind.CLOSE),
    )


def test_spec_omits_defaults() -> None:
    assert FaultRule(SEND, FaultKind.DROP).spec() == "transfer.send:drop"
    rule = FaultRule(TOKENS, FaultKind.DELAY, after=3, times=0, delay_s=0.25)
    assert rule.spec() == "worker.decode_tokens:delay:after=3,times=0,delay_s=0.25"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("transfer.send", "fault rule 'transfer.send': expected SITE:ACTION[:key=value,...]"),
        (
            "worker.nowhere:crash",
            "fault rule 'worker.nowhere:crash': unknown site 'worker.nowhere'",
        ),
        (
            "worker.prefill:explode",
            "fault rule 'worker.prefill:explode': unknown action 'explode' (allowed at"
            " worker.prefill: delay, close, stall, crash)",
        ),
        (
            "worker.prefill:corrupt",
            "fault rule 'worker.prefill:corrupt': action corrupt is not allowed at"
            " worker.prefill (allowed: delay, close, stall, crash)",
        ),
        (
            "transfer.recv_chunk:truncate",
            "fault rule 'transfer.recv_chunk:truncate': action truncate is not allowed at"
            " transfer.recv_chunk (allowed: delay, close, stall, crash)",
        ),
        ("worker.reserve:drop", "action drop is not allowed at worker.reserve"),
        ("transfer.send:drop:when=3", "unknown option 'when=3' (options: after, times,"),
        ("transfer.send:drop:after", "unknown option 'after'"),
        ("transfer.send:drop:after=two", "after='two' is not a valid int"),
        ("transfer.send:drop:after=1.5", "after='1.5' is not a valid int"),
        ("worker.prefill:delay:delay_s=soon", "delay_s='soon' is not a valid float"),
        ("transfer.send:drop:after=1,after=2", "option after given twice"),
        ("transfer.send:drop:after=-1", "after and times must be >= 0, got -1 and 1"),
        ("transfer.send:drop:times=-2", "after and times must be >= 0, got 0 and -2"),
        ("transfer.send:drop:probability=1.5", "probability must be in [0, 1], got 1.5"),
        ("transfer.send:drop:probability=nan", "probability must be in [0, 1], got nan"),
        ("worker.prefill:delay:delay_s=-1", "delay_s must be a finite number >= 0, got -1.0"),
        ("worker.prefill:delay:delay_s=inf", "delay_s must be a finite number >= 0, got inf"),
        ("worker.prefill:stall:delay_s=1", "delay_s applies to delay only, not stall"),
        ("transfer.send:drop:offset=3", "offset applies to corrupt and truncate (and delay"),
        ("worker.prefill:delay:offset=3", "offset applies to corrupt and truncate (and delay"),
        ("transfer.send:corrupt:offset=-3", "offset must be >= 0, got -3"),
    ],
)
def test_bad_rules_raise_config_error_naming_the_piece(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_rule(text)
    assert message in str(info.value)
    assert f"fault rule {text!r}" in str(info.value)


def test_a_rule_built_directly_is_validated_too() -> None:
    with pytest.raises(ConfigError, match=r"fault rule 'worker.reserve:truncate': action trunc"):
        FaultRule(FaultSite.WORKER_RESERVE, FaultKind.TRUNCATE)


def test_only_transfer_send_damages_bytes() -> None:
    assert set(allowed_actions(SEND)) == set(FaultKind) - {FaultKind.SHIFT}
    # KV in memory: damaged before its checksum, or landed one block off (the canary's tests).
    assert allowed_actions(FaultSite.TRANSFER_SOURCE_KV) == (FaultKind.CORRUPT,)
    assert allowed_actions(FaultSite.TRANSFER_RECV_MAP) == (FaultKind.SHIFT,)
    # The engine thread only waits: nothing there to close, and a stall would hang every request.
    assert allowed_actions(FaultSite.WORKER_ENGINE_STEP) == (FaultKind.DELAY,)
    special = {SEND, FaultSite.TRANSFER_SOURCE_KV, FaultSite.TRANSFER_RECV_MAP}
    for site in set(FaultSite) - special - {FaultSite.WORKER_ENGINE_STEP}:
        assert set(allowed_actions(site)) == {"delay", "close", "stall", "crash"}
    assert {s.value for s in FaultSite} == {
        "router.before_reserve",
        "router.after_prefill",
        "worker.reserve",
        "worker.prefill",
        "worker.prefill_reply",
        "worker.decode_tokens",
        "worker.engine_step",
        "transfer.send",
        "transfer.recv_chunk",
        "transfer.source_kv",
        "transfer.recv_map",
    }


@st.composite
def rules(draw: st.DrawFn) -> FaultRule:
    site = draw(st.sampled_from(list(FaultSite)))
    action = draw(st.sampled_from(allowed_actions(site)))
    delay_s = DEFAULT_DELAY_S
    if action is FaultKind.DELAY:
        delay_s = draw(st.floats(0.0, 1e6, allow_nan=False))
    offset = None
    if action in (FaultKind.CORRUPT, FaultKind.TRUNCATE):
        offset = draw(st.none() | st.integers(0, 1 << 40))
    return FaultRule(
        site,
        action,
        after=draw(st.integers(0, 1 << 40)),
        times=draw(st.integers(0, 1000)),
        probability=draw(st.floats(0.0, 1.0)),
        delay_s=delay_s,
        offset=offset,
    )


@given(rules())
def test_spec_round_trips(rule: FaultRule) -> None:
    assert parse_rule(rule.spec()) == rule


# ---- the injector --------------------------------------------------------------------------


def fires(injector: FaultInjector, site: FaultSite, num_hits: int) -> list[int]:
    """The hit indexes (of `num_hits` hits) on which a rule fired."""
    return [hit for hit in range(num_hits) if injector.fire(site) is not None]


def test_after_skips_hits_and_times_bounds_the_firings() -> None:
    assert fires(FaultInjector([parse_rule("transfer.send:drop:after=2")]), SEND, 6) == [2]
    three = FaultInjector([parse_rule("transfer.send:drop:after=1,times=3")])
    assert fires(three, SEND, 8) == [1, 2, 3]
    every = FaultInjector([parse_rule("transfer.send:drop:after=4,times=0")])
    assert fires(every, SEND, 8) == [4, 5, 6, 7]


def test_sites_count_their_own_hits_and_the_first_matching_rule_wins() -> None:
    injector = FaultInjector(
        parse_rules(
            [
                "worker.decode_tokens:close:after=1",
                "worker.decode_tokens:delay:times=0",
                "transfer.send:corrupt:after=2",
            ]
        )
    )
    actions = [getattr(injector.fire(TOKENS), "action", None) for _ in range(3)]
    assert actions == ["delay", "close", "delay"]
    assert fires(injector, SEND, 4) == [2]
    assert injector.fire(FaultSite.WORKER_PREFILL) is None
    assert injector.injected == [
        Injection(TOKENS, 0, FaultKind.DELAY),
        Injection(TOKENS, 1, FaultKind.CLOSE),
        Injection(TOKENS, 2, FaultKind.DELAY),
        Injection(SEND, 2, FaultKind.CORRUPT),
    ]
    assert injector.hits == {TOKENS: 3, SEND: 4, FaultSite.WORKER_PREFILL: 1}


def test_probability_draws_are_seeded_and_the_same_in_two_injectors() -> None:
    plan = parse_rules(["transfer.send:corrupt:probability=0.3,times=0"])
    a, b = FaultInjector(plan, seed=5), FaultInjector(plan, seed=5)
    hits_a = fires(a, SEND, 200)
    assert hits_a == fires(b, SEND, 200)
    assert 30 < len(hits_a) < 90  # about 30% of 200
    assert fires(FaultInjector(plan, seed=6), SEND, 200) != hits_a
    assert fires(FaultInjector(parse_rules(["transfer.send:drop:probability=0"])), SEND, 50) == []


def test_a_drawn_offset_is_seeded_and_in_range() -> None:
    plan = parse_rules(["transfer.send:corrupt:times=0"])
    a, b = FaultInjector(plan, seed=1), FaultInjector(plan, seed=1)
    offsets = [getattr(a.fire(SEND, 100), "offset", None) for _ in range(20)]
    assert offsets == [getattr(b.fire(SEND, 100), "offset", None) for _ in range(20)]
    assert all(o is not None and 0 <= o < 100 for o in offsets)
    assert len(set(offsets)) > 1
    fixed = FaultInjector(parse_rules(["transfer.send:truncate:offset=7"]))
    assert getattr(fixed.fire(SEND, 100), "offset", None) == 7
    assert getattr(FaultInjector(plan).fire(SEND), "offset", "") is None  # no size: no draw


def test_a_repeating_delay_warns_once_and_a_repeating_drop_every_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    step = FaultSite.WORKER_ENGINE_STEP
    pacing = FaultInjector([parse_rule("worker.engine_step:delay:times=0,delay_s=0.005")])
    dropping = FaultInjector([parse_rule("transfer.send:drop:times=0")])
    with caplog.at_level(logging.DEBUG, logger="pdserve.faults"):
        assert fires(pacing, step, 4) == [0, 1, 2, 3]
        assert fires(dropping, SEND, 3) == [0, 1, 2]
    levels = [(r.getMessage().split(" hit")[0], r.levelno) for r in caplog.records]
    assert levels == [
        ("fault injected at worker.engine_step", logging.WARNING),
        *[("fault injected at worker.engine_step", logging.DEBUG)] * 3,
        *[("fault injected at transfer.send", logging.WARNING)] * 3,
    ]


def test_reset_replaces_the_plan_and_the_counters() -> None:
    injector = FaultInjector(parse_rules(["transfer.send:drop"]))
    assert fires(injector, SEND, 3) == [0]
    injector.reset(parse_rules(["transfer.send:close:after=1"]), seed=9)
    assert (injector.injected, injector.num_injected, injector.hits, injector.seed) == (
        [],
        0,
        {},
        9,
    )
    assert fires(injector, SEND, 3) == [1]
    injector.reset()
    assert (injector.rules, fires(injector, SEND, 3)) == ((), [])
    assert injector.hits == {}  # an empty plan counts nothing: off is free


# ---- perform ---------------------------------------------------------------------------


def test_perform_delays_closes_and_stalls() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await perform(parse_rule("worker.prefill:delay:delay_s=0.05"))
        assert loop.time() - start >= 0.05
        with pytest.raises(FaultClosed, match=r"fault injected at worker\.reserve"):
            await perform(parse_rule("worker.reserve:close"))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await perform(parse_rule("worker.decode_tokens:stall"))
        with pytest.raises(ConfigError, match="acts on bytes only"):
            await perform(parse_rule("transfer.send:drop"))

    asyncio.run(main())


def test_fault_closed_is_a_connection_error() -> None:
    assert issubclass(FaultClosed, ConnectionResetError)


def test_a_rule_that_repeats_forever_keeps_a_bounded_record_and_counts_every_injection() -> None:
    injector = FaultInjector(parse_rules(["worker.engine_step:delay:times=0"]))
    for _ in range(RECORD_LIMIT + 5):
        injector.fire(FaultSite.WORKER_ENGINE_STEP)
    assert injector.num_injected == RECORD_LIMIT + 5
    record = injector.injected
    assert len(record) == RECORD_LIMIT
    assert (record[0].hit, record[-1].hit) == (5, RECORD_LIMIT + 4)  # the latest kept
