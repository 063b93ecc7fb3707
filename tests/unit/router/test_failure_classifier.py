"""Which failure is which: (phase, cause) -> failure, one table beside the recovery table."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.errors import NoCapacity, RouterError, WorkerCallError, WorkerUnreachable
from pdserve.protocol.worker_api import ErrorBody
from pdserve.router.flows.recovery import (
    CLASSIFY,
    RECOVERY,
    Cause,
    Failure,
    Phase,
    Step,
    cause_of,
    classify,
)


def call_error(status: int, retryable: bool = False, kind: str = "X") -> WorkerCallError:
    return WorkerCallError("http://w", status, ErrorBody(error="e", type=kind, retryable=retryable))


@pytest.mark.parametrize(
    ("phase", "cause", "failure"),
    [
        (Phase.RESERVE, Cause.NO_PREFILL, Failure.NO_PREFILL_WORKER),
        (Phase.RESERVE, Cause.REFUSED, None),  # no decode capacity: the capacity queue's
        (Phase.PREFILL, Cause.UNREACHABLE, Failure.PREFILL_FAILED),
        (Phase.PREFILL, Cause.REFUSED, Failure.PREFILL_FAILED),
        (Phase.PREFILL, Cause.BAD_REQUEST, None),
        (Phase.HANDOFF, Cause.UNREACHABLE, Failure.HANDOFF_FAILED),
        # The decode side's reservation expired while the prefill worker was paused: the
        # request is re-prefilled, never answered with a 502.
        (Phase.HANDOFF, Cause.STATE_LOST, Failure.HANDOFF_FAILED),
        (Phase.HANDOFF, Cause.FATAL, None),
        (Phase.DECODE, Cause.UNREACHABLE, Failure.DECODE_DIED),
        (Phase.DECODE, Cause.STATE_LOST, Failure.DECODE_DIED),
        (Phase.DECODE, Cause.BAD_REQUEST, None),
        (Phase.RESUME, Cause.REFUSED, Failure.RESUME_FAILED),
        (Phase.RESUME, Cause.FATAL, None),
    ],
)
def test_rows(phase: Phase, cause: Cause, failure: Failure | None) -> None:
    assert classify(phase, cause) is failure


@pytest.mark.parametrize(
    ("exc", "cause"),
    [
        (WorkerUnreachable("http://w", "reset"), Cause.UNREACHABLE),
        (call_error(400, retryable=True), Cause.BAD_REQUEST),
        (call_error(404), Cause.STATE_LOST),
        (call_error(410, retryable=True, kind="StaleInstance"), Cause.STATE_LOST),
        (call_error(503), Cause.REFUSED),
        (call_error(500, retryable=True, kind="ChecksumMismatch"), Cause.REFUSED),
        (call_error(500, kind="DeadlineExceeded"), Cause.FATAL),
        (NoCapacity("none"), Cause.REFUSED),
        (RouterError("other"), Cause.FATAL),
    ],
)
def test_causes_come_from_status_and_the_retryable_flag(exc: RouterError, cause: Cause) -> None:
    assert cause_of(exc) is cause


def test_every_failure_is_reachable_and_has_steps() -> None:
    assert set(CLASSIFY.values()) == set(Failure) == set(RECOVERY)


@given(
    st.sampled_from(list(Phase)),
    st.integers(100, 599),
    st.booleans(),
    st.sampled_from(["X", "DeadlineExceeded", "Overloaded"]),
)
def test_no_worker_answer_is_recovered_in_a_way_that_repeats_tokens(
    phase: Phase, status: int, retryable: bool, kind: str
) -> None:
    failure = classify(phase, cause_of(call_error(status, retryable, kind)))
    if status == 400:
        assert failure is None  # the request itself: every worker would refuse it
    if failure is None:
        return
    # After the commit (tokens decoded and sent) only a migration follows: it resumes after
    # the tokens the client has, where a re-prefill or local prefill would start over.
    if phase in (Phase.DECODE, Phase.RESUME):
        assert RECOVERY[failure] == (Step.MIGRATE,)
    else:
        assert Step.MIGRATE not in RECOVERY[failure]
