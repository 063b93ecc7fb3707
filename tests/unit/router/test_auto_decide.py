"""The automatic mode's decisions: every rule on synthetic figures, the hysteresis, and replays
of curves recorded from real clusters (`benchmarks/record_auto_curve.py`: 2 or 3 `both`
workers of the tiny model, `--mode auto`, a load of short prompts, then long prompts, then a
trickle; the router's `GET /admin/auto` saved as JSON in `data/`)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest

from pdserve.errors import ConfigError
from pdserve.router.main import config_from_args
from pdserve.router.mode.auto_mode import (
    Action,
    AutoConfig,
    AutoInputs,
    AutoMemory,
    BreakerHealth,
    Decision,
    Layout,
    PhaseLoad,
    Reason,
    decide,
    prefill_count,
)
from pdserve.router.mode.control import FiguresView
from pdserve.router.mode.interference import DecodeFigures, LiveFigures, SLOConfig

DATA = Path(__file__).parent / "data"
SLO = SLOConfig(ttft_s=2.0, tpot_s=0.010)
FAST = AutoConfig(sustain=1, min_dwell_s=0.0, min_requests=5)


def figures(**kw: Any) -> LiveFigures:
    """A busy colocated window where prefill broke the TPOT SLO (override any field)."""
    base = LiveFigures(
        window_s=10.0,
        with_prefill=DecodeFigures(6, 0.120, 0.110, 0.180),
        without_prefill=DecodeFigures(400, 0.004, 0.003, 0.007),
        num_requests=20,
        ttft_attainment=1.0,
        tpot_attainment=0.7,
        attainment=0.7,
        request_tpot_p90_s=0.02,
        num_tpot_missed=6,
        num_tpot_missed_interfered=5,
        arrival_rate=4.0,
        prompt_tokens_per_s=4000.0,
        output_tokens_per_s=80.0,
    )
    return dataclasses.replace(base, **kw)


BUSY = PhaseLoad(6.0, 4.0)


def inputs(
    now: float = 100.0,
    n: int = 2,
    breaker: BreakerHealth = BreakerHealth.CLOSED,
    load: PhaseLoad = BUSY,
    **kw: Any,
) -> AutoInputs:
    return AutoInputs(now, figures(**kw), n, breaker, load)


def once(memory: AutoMemory, i: AutoInputs, config: AutoConfig = FAST) -> Decision:
    return decide(memory, i, config, SLO)[0]


COLOCATED = AutoMemory()
SPLIT = AutoMemory(Layout(1), changed_at_s=0.0, split_prompt_tokens_per_s=4000.0)


def test_interference_that_breaks_the_tpot_slo_splits_at_the_busy_share() -> None:
    d = once(COLOCATED, inputs(n=4, load=PhaseLoad(6.0, 4.0)))
    assert (d.action, d.reason, d.layout) == (Action.SPLIT, Reason.INTERFERENCE, Layout(2))
    assert "5 of 6 misses interfered" in d.detail and "-> 2:2" in d.detail
    assert once(COLOCATED, inputs(n=4, load=PhaseLoad(9.0, 1.0))).layout == Layout(3)
    assert once(COLOCATED, inputs(n=2, load=PhaseLoad(9.0, 1.0))).layout == Layout(1)


@pytest.mark.parametrize(
    ("n", "share", "p"), [(2, 0.9, 1), (3, 0.6, 2), (3, 0.1, 1), (5, 0.5, 2), (4, math.nan, 2)]
)
def test_prefill_count_keeps_one_worker_of_each_role(n: int, share: float, p: int) -> None:
    assert prefill_count(n, share) == p


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"n": 1}, Reason.TOO_FEW_WORKERS),
        ({"breaker": BreakerHealth.OPEN}, Reason.BREAKER_OPEN),
        ({"num_requests": 4}, Reason.FEW_SAMPLES),
        ({"tpot_attainment": 0.95}, Reason.WITHIN_SLO),
        ({"without_prefill": DecodeFigures(9, 0.004, 0.003, 0.005)}, Reason.FEW_SAMPLES),
        ({"without_prefill": DecodeFigures(400, 0.012, 0.011, 0.02)}, Reason.DECODE_BOUND),
        ({"num_tpot_missed_interfered": 2}, Reason.NOT_INTERFERENCE),
    ],
)
def test_colocated_stays_unless_prefill_is_why_tpot_is_missed(
    change: dict[str, Any], reason: Reason
) -> None:
    d = once(COLOCATED, inputs(**change))
    assert (d.action, d.reason, d.layout) == (Action.KEEP, reason, Layout())


def test_a_half_open_breaker_does_not_block_a_split() -> None:
    assert once(COLOCATED, inputs(breaker=BreakerHealth.PROBING)).action is Action.SPLIT


@pytest.mark.parametrize(
    ("change", "action", "reason", "layout"),
    [
        ({"breaker": BreakerHealth.OPEN}, Action.COLOCATE, Reason.BREAKER_OPEN, Layout()),
        ({"n": 1}, Action.COLOCATE, Reason.TOO_FEW_WORKERS, Layout()),
        ({"prompt_tokens_per_s": 1900.0}, Action.COLOCATE, Reason.LOAD_FELL, Layout()),
        ({"tpot_attainment": 1.0}, Action.KEEP, Reason.WITHIN_SLO, Layout(1)),
        ({"num_requests": 2}, Action.KEEP, Reason.FEW_SAMPLES, Layout(1)),
        ({"ttft_attainment": 0.5, "tpot_attainment": 1.0}, Action.KEEP, Reason.AT_LIMIT, Layout(1)),
        ({"ttft_attainment": 0.5}, Action.KEEP, Reason.AT_LIMIT, Layout(1)),
        ({}, Action.COLOCATE, Reason.SPLIT_NOT_HELPING, Layout()),
    ],
)
def test_a_split_goes_back_when_load_falls_the_breaker_opens_or_it_does_not_help(
    change: dict[str, Any], action: Action, reason: Reason, layout: Layout
) -> None:
    n = change.pop("n", 2)
    breaker = change.pop("breaker", BreakerHealth.CLOSED)
    d = once(SPLIT, inputs(n=n, breaker=breaker, **change))
    assert (d.action, d.reason, d.layout) == (action, reason, layout)


def test_a_split_resizes_towards_the_phase_that_misses_its_slo() -> None:
    two_two = dataclasses.replace(SPLIT, layout=Layout(2))
    prefill_bound = once(two_two, inputs(n=4, ttft_attainment=0.5, tpot_attainment=1.0))
    assert (prefill_bound.action, prefill_bound.reason) == (Action.RESIZE, Reason.PREFILL_BOUND)
    assert prefill_bound.layout == Layout(3)
    decode_bound = once(two_two, inputs(n=4))
    assert (decode_bound.reason, decode_bound.layout) == (Reason.DECODE_BOUND, Layout(1))
    lost = once(dataclasses.replace(SPLIT, layout=Layout(3)), inputs(n=3))
    assert (lost.action, lost.reason, lost.layout) == (
        Action.RESIZE,
        Reason.TOO_FEW_WORKERS,
        Layout(2),
    )


def test_a_change_needs_sustained_proposals_and_the_dwell_time() -> None:
    config = AutoConfig(sustain=3, min_dwell_s=20.0, min_requests=5)
    memory = AutoMemory(changed_at_s=90.0)
    seen = []
    for now in (100.0, 101.0, 102.0, 103.0, 110.0, 111.0):
        decision, memory = decide(memory, inputs(now=now), config, SLO)
        seen.append((decision.action, decision.reason))
    assert seen == [
        (Action.KEEP, Reason.SUSTAINING),
        (Action.KEEP, Reason.SUSTAINING),
        (Action.KEEP, Reason.DWELL),  # third proposal, but only 12 s since the last change
        (Action.KEEP, Reason.DWELL),
        (Action.SPLIT, Reason.INTERFERENCE),  # 20 s after the last change
        (Action.KEEP, Reason.SUSTAINING),  # the split's own figures: not helping, 1 of 3
    ]
    assert memory.layout == Layout(1) and memory.split_prompt_tokens_per_s == 4000.0
    # An interruption restarts the count.
    _, m = decide(AutoMemory(), inputs(), config, SLO)
    _, m = decide(m, inputs(tpot_attainment=1.0), config, SLO)
    assert m.num_pending == 0


def test_the_breaker_colocates_at_once_whatever_the_hysteresis() -> None:
    config = AutoConfig(sustain=5, min_dwell_s=60.0)
    memory = dataclasses.replace(SPLIT, changed_at_s=99.0)
    d, after = decide(memory, inputs(breaker=BreakerHealth.OPEN), config, SLO)
    assert (d.action, d.layout, after.changed_at_s) == (Action.COLOCATE, Layout(), 100.0)


def test_after_a_split_that_did_not_help_no_split_for_the_backoff() -> None:
    config = AutoConfig(sustain=1, min_dwell_s=0.0, min_requests=5, split_backoff_s=60.0)
    d, memory = decide(SPLIT, inputs(now=100.0), config, SLO)
    assert d.reason is Reason.SPLIT_NOT_HELPING and memory.no_split_before_s == 160.0
    d, memory = decide(memory, inputs(now=159.0), config, SLO)
    assert (d.action, d.reason) == (Action.KEEP, Reason.BACKOFF)
    d, memory = decide(memory, inputs(now=160.0), config, SLO)
    assert d.action is Action.SPLIT


def test_flapping_figures_never_change_the_layout() -> None:
    config = AutoConfig(sustain=3, min_dwell_s=0.0, min_requests=5)
    memory = AutoMemory()
    for k in range(40):
        bad = k % 3 != 2  # two windows over the SLO, one within: never three in a row
        d, memory = decide(
            memory, inputs(now=100.0 + k, tpot_attainment=0.5 if bad else 1.0), config, SLO
        )
        assert d.action is Action.KEEP
    assert memory.layout == Layout()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--auto-interval-s", "0"], "--auto-interval-s"),
        (["--auto-window-s", "nan"], "--auto-window-s"),
        (["--auto-min-dwell-s", "-1"], "--auto-min-dwell-s"),
        (["--auto-sustain", "0"], "--auto-sustain"),
        (["--auto-min-requests", "0"], "--auto-min-requests"),
        (["--auto-target-attainment", "1.5"], "--auto-target-attainment"),
        (["--auto-low-water", "1"], "--auto-low-water"),
        (["--auto-split-backoff-s", "-5"], "--auto-split-backoff-s"),
        (["--slo-tpot-ms", "0"], "--slo-tpot-ms"),
        (["--slo-ttft-ms", "inf"], "--slo-ttft-ms"),
        # A lease or a wait that would outlive any liveness check (workers refuse them too).
        (["--lease-ttl-s", "1e300"], "lease-ttl-s: must be in"),
        (["--checkpoint-lease-ttl-s", "7200"], "checkpoint-lease-ttl-s: must be in"),
        (["--request-timeout-s", "1e9"], "request-timeout-s: must be in"),
    ],
)
def test_bad_router_flags_are_refused_naming_them(
    flags: list[str], named: str, tiny_model_path: Path
) -> None:
    with pytest.raises(ConfigError, match=named):
        config_from_args(["--worker", "http://w", "--model", str(tiny_model_path), *flags])


# ---- recorded curves ---------------------------------------------------------------------


def _recorded(name: str) -> tuple[AutoConfig, SLOConfig, list[dict[str, Any]]]:
    data = json.loads((DATA / name).read_text())
    args = data["router_args"]
    value = {args[i]: args[i + 1] for i in range(0, len(args) - 1, 2)}
    config = AutoConfig(
        window_s=float(value["--auto-window-s"]),
        min_dwell_s=float(value["--auto-min-dwell-s"]),
        sustain=int(value["--auto-sustain"]),
        min_requests=int(value["--auto-min-requests"]),
    )
    slo = SLOConfig(float(value["--slo-ttft-ms"]) / 1e3, float(value["--slo-tpot-ms"]) / 1e3)
    return config, slo, data["evaluations"]


def _replay(name: str) -> list[tuple[str, str, int]]:
    """Every recorded evaluation's inputs through `decide`, asserting it decides as the live
    router did; returns the (action, reason, num_prefill) of the changes."""
    config, slo, evaluations = _recorded(name)
    memory = AutoMemory()
    changes = []
    for e in evaluations:
        i = AutoInputs(
            now_s=e["at_s"],
            figures=FiguresView.model_validate(e["figures"]).to_figures(),
            num_workers=e["num_workers"],
            breaker=BreakerHealth(e["breaker"]),
            load=PhaseLoad(e["prefill_busy_s"], e["decode_busy_s"]),
        )
        decision, memory = decide(memory, i, config, slo)
        got = (decision.action.value, decision.reason.value, decision.layout.num_prefill)
        assert got == (e["action"], e["reason"], e["num_prefill"]), e["detail"]
        if decision.action is not Action.KEEP:
            changes.append(got)
    return changes


def test_recorded_two_workers_split_on_interference_then_undo_a_split_that_missed_tpot() -> None:
    # Recorded while other work loaded the 2-core machine: the split's decode worker, sharing
    # the cores with the prefill worker, missed the TPOT SLO too, so the split was undone.
    assert _replay("auto_curve_2_workers_split_not_helping.json") == [
        ("split", "interference", 1),
        ("colocate", "split_not_helping", 0),
    ]


def test_recorded_three_workers_size_the_split_from_busy_time_then_resize() -> None:
    # Long prompts: prefill took most of the busy time, so 2 prefill : 1 decode; the decode
    # side then missed TPOT: 1 : 2; still missing with one prefill worker: colocated again.
    assert _replay("auto_curve_3_workers_resize.json") == [
        ("split", "interference", 2),
        ("resize", "decode_bound", 1),
        ("colocate", "split_not_helping", 0),
    ]


def test_recorded_curves_hold_every_change_apart_by_the_dwell_time() -> None:
    for name in sorted(p.name for p in DATA.glob("auto_curve_*.json")):
        config, _, evaluations = _recorded(name)
        times = [e["at_s"] for e in evaluations if e["action"] != "keep" and e["reason"] not in (
            "breaker_open", "too_few_workers")]  # fmt: skip
        assert all(b - a >= config.min_dwell_s for a, b in itertools.pairwise(times))
