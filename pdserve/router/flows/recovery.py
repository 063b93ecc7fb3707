"""The failure policy of a disaggregated request, as a table. Pure.

When a step of a request fails, `classify` names what happened (`Failure`) from where it
failed (`Phase`) and what the error says about the worker (`Cause`, from `cause_of`); the
failure decides which recovery steps may follow, in order (`RECOVERY`); the router's
configuration (`--recovery`) and the request's budget (`Budget`: re-prefills and migrations
left) decide which of them is taken (`next_step`). No failure (a bad request, a deadline) or
no step left: the request fails with the error that ended its last step.

    phase    cause (unreachable, refused or state_lost)   failure             steps, in order
    reserve  no_prefill: no usable prefill worker         no_prefill_worker   local_prefill
    prefill  /prefill errored or the worker died          prefill_failed      reprefill, local_prefill
    handoff  /decode failed before the commit (transfer   handoff_failed      reprefill, local_prefill
             failed, KV failed its value check, the
             reservation expired or was lost)
    decode   the decode stream broke after the commit     decode_died         migrate
    resume   a local-prefill or migration stream broke    resume_failed       migrate

A worker that no longer knows the request (404: its reservation or lease expired while the
other side was paused) or that restarted at the same address since the router last read it
(410 StaleInstance: the call was signed for its earlier life) is `state_lost`: recoverable
like a dead worker, never a 502.

`retry_transfer` (resending the held snapshot) happens inside the prefill worker, before a
handoff counts as failed, so it is not a step here.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pdserve.errors import RouterError, WorkerCallError, WorkerUnreachable
from pdserve.protocol.request_state import Reason


class Phase(enum.Enum):
    """Where in a disaggregated request a step failed."""

    RESERVE = "reserve"  # choosing and reserving the decode/prefill pair
    PREFILL = "prefill"  # POST /prefill
    HANDOFF = "handoff"  # POST /decode before its first line (the commit)
    DECODE = "decode"  # the decode stream after the commit
    RESUME = "resume"  # POST /generate of a local prefill or a migration


class Cause(enum.Enum):
    """What an error says about the worker that raised it."""

    UNREACHABLE = "unreachable"  # connection refused, reset or timed out; the stream broke
    REFUSED = "refused"  # a refusal another worker may not share (503, no blocks, bad KV)
    # 404: it no longer knows the request (expired); 410: the call was signed for an earlier
    # life of the worker (it restarted at the same address, StaleInstance).
    STATE_LOST = "state_lost"
    BAD_REQUEST = "bad_request"  # 400: the request itself; every worker would say the same
    FATAL = "fatal"  # anything else that is not worth another worker (a deadline)
    NO_PREFILL = "no_prefill"  # decode workers are up, none has a usable prefill partner


def cause_of(exc: RouterError) -> Cause:
    """The cause an error stands for (the status and retryable flag, never the message)."""
    if isinstance(exc, WorkerUnreachable):
        return Cause.UNREACHABLE
    if isinstance(exc, WorkerCallError) and exc.status == 400:
        return Cause.BAD_REQUEST
    if isinstance(exc, WorkerCallError) and exc.status in (404, 410):
        return Cause.STATE_LOST
    return Cause.REFUSED if exc.retryable else Cause.FATAL


class Failure(enum.Enum):
    """What ended a step."""

    NO_PREFILL_WORKER = "no_prefill_worker"
    PREFILL_FAILED = "prefill_failed"
    HANDOFF_FAILED = "handoff_failed"
    DECODE_DIED = "decode_died"
    RESUME_FAILED = "resume_failed"


class Step(enum.Enum):
    """A recovery step; `config_name` is its name in `--recovery` (None: always allowed)."""

    REPREFILL = "reprefill"
    LOCAL_PREFILL = "local_prefill"
    MIGRATE = "migrate"

    @property
    def config_name(self) -> str | None:
        return None if self is Step.MIGRATE else self.value


RECOVERY: Mapping[Failure, tuple[Step, ...]] = MappingProxyType(
    {
        Failure.NO_PREFILL_WORKER: (Step.LOCAL_PREFILL,),
        Failure.PREFILL_FAILED: (Step.REPREFILL, Step.LOCAL_PREFILL),
        Failure.HANDOFF_FAILED: (Step.REPREFILL, Step.LOCAL_PREFILL),
        Failure.DECODE_DIED: (Step.MIGRATE,),
        Failure.RESUME_FAILED: (Step.MIGRATE,),
    }
)

_WORKER_FAULTS = (Cause.UNREACHABLE, Cause.REFUSED, Cause.STATE_LOST)

# (phase, cause) -> failure; a pair not here is not recoverable.
CLASSIFY: Mapping[tuple[Phase, Cause], Failure] = MappingProxyType(
    {
        (Phase.RESERVE, Cause.NO_PREFILL): Failure.NO_PREFILL_WORKER,
        **{(Phase.PREFILL, c): Failure.PREFILL_FAILED for c in _WORKER_FAULTS},
        **{(Phase.HANDOFF, c): Failure.HANDOFF_FAILED for c in _WORKER_FAULTS},
        **{(Phase.DECODE, c): Failure.DECODE_DIED for c in _WORKER_FAULTS},
        **{(Phase.RESUME, c): Failure.RESUME_FAILED for c in _WORKER_FAULTS},
    }
)


def classify(phase: Phase, cause: Cause) -> Failure | None:
    """The failure a step's error is (None: not recoverable, the request fails with it)."""
    return CLASSIFY.get((phase, cause))


class StepFailed(Exception):
    """A step ended without finishing the request; the recovery table decides what follows."""

    def __init__(self, failure: Failure, cause: RouterError, decode_url: str | None = None):
        super().__init__(str(cause))
        self.failure = failure
        self.cause = cause
        # The decode worker a local prefill should try first (the one that was chosen).
        self.decode_url = decode_url


def fail_step(
    phase: Phase, exc: RouterError, cause: Cause | None = None, decode_url: str | None = None
) -> None:
    """Raise `StepFailed` if the recovery table can answer `exc` in `phase`; else return (the
    caller re-raises `exc`: the request fails with it)."""
    failure = classify(phase, cause_of(exc) if cause is None else cause)
    if failure is not None:
        raise StepFailed(failure, exc, decode_url) from exc


# The timeline reason recorded when a step is taken after a failure.
STEP_REASON: Mapping[tuple[Failure, Step], Reason] = MappingProxyType(
    {
        (Failure.PREFILL_FAILED, Step.REPREFILL): Reason.PREFILL_FAILED,
        (Failure.HANDOFF_FAILED, Step.REPREFILL): Reason.REPREFILL,
        (Failure.NO_PREFILL_WORKER, Step.LOCAL_PREFILL): Reason.LOCAL_PREFILL,
        (Failure.PREFILL_FAILED, Step.LOCAL_PREFILL): Reason.LOCAL_PREFILL,
        (Failure.HANDOFF_FAILED, Step.LOCAL_PREFILL): Reason.LOCAL_PREFILL,
        (Failure.DECODE_DIED, Step.MIGRATE): Reason.MIGRATION,
        (Failure.RESUME_FAILED, Step.MIGRATE): Reason.RESUME_FAILED,
    }
)


@dataclass(slots=True)
class Budget:
    """What a request may still spend on recovery."""

    reprefills: int
    migrations: int

    def allows(self, step: Step) -> bool:
        """Whether the budget has room for `step`."""
        if step is Step.REPREFILL:
            return self.reprefills > 0
        if step is Step.MIGRATE:
            return self.migrations > 0
        return True

    def spend(self, step: Step) -> None:
        """Account for taking `step`."""
        if step is Step.REPREFILL:
            self.reprefills -= 1
        elif step is Step.MIGRATE:
            self.migrations -= 1


def next_step(failure: Failure, enabled: Collection[str], budget: Budget) -> Step | None:
    """The first step the table allows after `failure` that is enabled and within budget."""
    for step in RECOVERY[failure]:
        name = step.config_name
        if (name is None or name in enabled) and budget.allows(step):
            return step
    return None
