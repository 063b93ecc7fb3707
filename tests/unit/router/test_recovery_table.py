"""The failure policy as a table: which step follows which failure, within budget and config."""

from __future__ import annotations

from pdserve.protocol.request_state import Reason
from pdserve.router.config import RECOVERY_STEPS
from pdserve.router.flows.recovery import RECOVERY, STEP_REASON, Budget, Failure, Step, next_step

ALL = RECOVERY_STEPS


def test_the_table_covers_every_failure_and_every_pair_has_a_reason() -> None:
    assert set(RECOVERY) == set(Failure)
    for failure, steps in RECOVERY.items():
        for step in steps:
            assert isinstance(STEP_REASON[(failure, step)], Reason)


def test_steps_follow_the_table_in_order_within_budget() -> None:
    budget = Budget(reprefills=1, migrations=2)
    assert next_step(Failure.HANDOFF_FAILED, ALL, budget) is Step.REPREFILL
    budget.spend(Step.REPREFILL)
    # Budget spent: the next failure of the same kind falls back to local prefill.
    assert next_step(Failure.HANDOFF_FAILED, ALL, budget) is Step.LOCAL_PREFILL
    assert next_step(Failure.NO_PREFILL_WORKER, ALL, budget) is Step.LOCAL_PREFILL
    assert next_step(Failure.DECODE_DIED, ALL, budget) is Step.MIGRATE
    budget.spend(Step.MIGRATE)
    budget.spend(Step.MIGRATE)
    assert next_step(Failure.RESUME_FAILED, ALL, budget) is None  # out of migrations


def test_disabled_steps_are_skipped() -> None:
    budget = Budget(reprefills=3, migrations=3)
    assert next_step(Failure.PREFILL_FAILED, ("local_prefill",), budget) is Step.LOCAL_PREFILL
    assert next_step(Failure.PREFILL_FAILED, ("reprefill",), budget) is Step.REPREFILL
    assert next_step(Failure.NO_PREFILL_WORKER, ("reprefill",), budget) is None
    # Migration is not a configurable step: only its budget limits it.
    assert next_step(Failure.DECODE_DIED, (), budget) is Step.MIGRATE
    assert next_step(Failure.DECODE_DIED, (), Budget(0, 0)) is None
