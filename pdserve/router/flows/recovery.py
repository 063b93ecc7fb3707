"""The failure policy of a disaggregated request, as a table. Pure.

When a step of a request fails, what happened (`Failure`) decides which recovery steps may
follow, in order (`RECOVERY`); the router's configuration (`--recovery`) and the request's
budget (`Budget`: re-prefills and migrations left) decide which of them is taken
(`next_step`). None left: the request fails with the error that ended its last step.

    failure             detection                                 steps, in order
    no_prefill_worker   no healthy compatible prefill worker      local_prefill
    prefill_failed      /prefill errored or the worker died       reprefill, local_prefill
    handoff_failed      /decode failed before the commit (the     reprefill, local_prefill
                        transfer failed, the KV failed its value
                        check, the reservation was lost)
    decode_died         the decode stream broke after the commit  migrate
    resume_failed       a local-prefill or migration stream broke migrate

`retry_transfer` (resending the held snapshot) happens inside the prefill worker, before a
handoff counts as failed, so it is not a step here.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pdserve.protocol.request_state import Reason


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
