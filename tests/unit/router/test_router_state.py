"""The request state table, exhausted: every (state, target) pair is allowed iff listed."""

from __future__ import annotations

import itertools

import pytest

from pdserve.errors import IllegalRequestTransition
from pdserve.protocol.request_state import (
    TERMINAL,
    TRANSITIONS,
    Reason,
    RequestState,
    RequestTimeline,
)

S = RequestState
DISAGG_PATH = [
    S.ROUTED, S.RESERVED, S.PREFILLING, S.PREFILLED, S.TRANSFERRING, S.COMMITTED, S.DECODING,
    S.FINISHED,
]  # fmt: skip


def _at(state: RequestState) -> RequestTimeline:
    # Reach `state` along some legal path (the table is connected from RECEIVED).
    paths = {
        S.RECEIVED: [],
        S.RETRYING: [S.ROUTED, S.RETRYING],
        S.FAILED: [S.FAILED],
    }
    path = paths[state] if state in paths else DISAGG_PATH[: DISAGG_PATH.index(state) + 1]
    timeline = RequestTimeline("r", "disagg")
    for target in path:
        timeline.advance(target, reason=_reason(target))
    assert timeline.state is state
    return timeline


def _reason(target: RequestState) -> Reason | None:
    return Reason.MIGRATION if target is S.RETRYING else None


@pytest.mark.parametrize(("current", "target"), list(itertools.product(S, S)))
def test_every_pair_follows_the_table(current: RequestState, target: RequestState) -> None:
    timeline = _at(current)
    before = list(timeline.history)
    if target in TRANSITIONS[current]:
        timeline.advance(target, "why", _reason(target))
        assert timeline.state is target
        assert timeline.history[-1].detail == "why"
        assert timeline.history[-1].reason is _reason(target)
    else:
        with pytest.raises(IllegalRequestTransition):
            timeline.advance(target, reason=_reason(target))
        assert timeline.history == before  # unchanged


def test_table_covers_every_state_and_terminals_are_final() -> None:
    assert set(TRANSITIONS) == set(S)
    assert {S.FINISHED, S.FAILED} == TERMINAL
    for state in TERMINAL:
        assert TRANSITIONS[state] == frozenset()
    for state in set(S) - TERMINAL:
        assert S.FAILED in TRANSITIONS[state]


def test_disagg_and_colocated_paths_with_timestamps() -> None:
    timeline = _at(S.FINISHED)
    assert [t.state for t in timeline.history] == [S.RECEIVED, *DISAGG_PATH]
    stamps = [t.monotonic_ns for t in timeline.history]
    assert stamps == sorted(stamps)
    assert all(t.wall_time_s > 1e9 for t in timeline.history)
    assert timeline.elapsed_s(S.PREFILLED) is not None
    assert timeline.first_ns(S.RETRYING) is None

    colocated = RequestTimeline("c", "colocated")
    for target in (S.ROUTED, S.DECODING, S.FINISHED):
        colocated.advance(target)
    assert colocated.done


def test_a_recovery_may_start_before_anything_was_routed() -> None:
    # No prefill worker usable at all: the decode side prefills (the 500 of issue 14 was an
    # illegal RECEIVED -> RETRYING here).
    timeline = RequestTimeline("r", "disagg")
    timeline.retry(Reason.LOCAL_PREFILL, "no prefill worker")
    timeline.advance(S.ROUTED)
    assert [t.state for t in timeline.history] == [S.RECEIVED, S.RETRYING, S.ROUTED]


def test_retry_returns_to_an_earlier_state_and_fail_is_idempotent() -> None:
    timeline = _at(S.PREFILLING)
    timeline.retry(Reason.PREFILL_FAILED, "prefill worker died")
    timeline.advance(S.ROUTED)
    timeline.fail("gave up")
    timeline.fail("again")  # no-op once terminal
    assert timeline.state is S.FAILED
    assert [t.detail for t in timeline.history if t.state is S.FAILED] == ["gave up"]
