"""What each engine step computed and how long it took: the raw facts of prefill-decode
interference. Pure: no clocks (the engine passes the measured duration), no I/O.

A step's scheduled slices are classified by what they cost, not by where the request is in
its life: a **decode** slice computes exactly one token of a request that already has an output
token (the token sampled by its previous step, or the first token a remote prefill sent); every
other slice is **prefill** (a prompt chunk, a recompute after preemption, a resumed request's
tokens). A step is

    decode-only   decode slices only          (what a decode worker runs when split)
    prefill-only  prefill slices only          (what a prefill worker runs when split)
    mixed         both: the decode tokens waited for the prefill chunk (interference)

`StepTotals` keeps cumulative counts and seconds per kind, and attributes busy time to the two
phases: a decode-only step is all decode, a prefill-only step all prefill; of a mixed step, the
decode part is what a decode-only step costs now (an exponential average of recent decode-only
steps, capped at the mixed step's duration) and the rest is the prefill's. That attribution
answers "how much engine time would each phase need on its own", which is what a P:D ratio
is sized from (`pdserve.router.mode.auto_mode`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class StepKind(enum.Enum):
    """What shared one step's batch."""

    DECODE = "decode"
    PREFILL = "prefill"
    MIXED = "mixed"


@dataclass(frozen=True, slots=True)
class StepFacts:
    """One step as it ran."""

    # Steps this engine ran before this one.
    index: int
    duration_s: float
    # Tokens computed by prefill slices and by decode slices (one per decoding request).
    num_prefill_tokens: int
    num_decode_tokens: int

    @property
    def kind(self) -> StepKind:
        """Decode-only, prefill-only or mixed."""
        if self.num_prefill_tokens == 0:
            return StepKind.DECODE
        return StepKind.MIXED if self.num_decode_tokens > 0 else StepKind.PREFILL

    @property
    def with_prefill(self) -> bool:
        """True when prefill tokens were computed in this step (decode tokens waited for them)."""
        return self.num_prefill_tokens > 0


def is_decode_slice(num_new_tokens: int, num_output_tokens: int) -> bool:
    """One token of a request that already has an output token: a decode slice."""
    return num_new_tokens == 1 and num_output_tokens > 0


def count_tokens(slices: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """(prefill tokens, decode tokens) of a step's (num_new_tokens, num_output_tokens) slices."""
    prefill = decode = 0
    for num_new, num_output in slices:
        if is_decode_slice(num_new, num_output):
            decode += 1
        else:
            prefill += num_new
    return prefill, decode


# Weight of the newest decode-only step in the running estimate of a decode step's cost.
_BASELINE_ALPHA = 0.2


@dataclass(slots=True)
class StepTotals:
    """Cumulative step figures of one engine since it started (read by /health and /metrics)."""

    num_steps: int = 0
    # Steps and their seconds per kind.
    num_decode_steps: int = 0
    num_prefill_steps: int = 0
    num_mixed_steps: int = 0
    decode_steps_s: float = 0.0
    prefill_steps_s: float = 0.0
    mixed_steps_s: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # Busy seconds attributed to each phase (see the module docstring); they sum to the busy
    # time of every step.
    prefill_busy_s: float = 0.0
    decode_busy_s: float = 0.0
    # Running estimate of a decode-only step's seconds; None before the first one.
    decode_step_baseline_s: float | None = None

    @property
    def busy_s(self) -> float:
        """Seconds the engine spent stepping."""
        return self.decode_steps_s + self.prefill_steps_s + self.mixed_steps_s

    def observe(self, step: StepFacts) -> None:
        """Count one step."""
        self.num_steps += 1
        self.num_prefill_tokens += step.num_prefill_tokens
        self.num_decode_tokens += step.num_decode_tokens
        t = step.duration_s
        kind = step.kind
        if kind is StepKind.DECODE:
            self.num_decode_steps += 1
            self.decode_steps_s += t
            self.decode_busy_s += t
            base = self.decode_step_baseline_s
            self.decode_step_baseline_s = (
                t if base is None else (1 - _BASELINE_ALPHA) * base + _BASELINE_ALPHA * t
            )
        elif kind is StepKind.PREFILL:
            self.num_prefill_steps += 1
            self.prefill_steps_s += t
            self.prefill_busy_s += t
        else:
            self.num_mixed_steps += 1
            self.mixed_steps_s += t
            total = step.num_prefill_tokens + step.num_decode_tokens
            # No decode-only step seen yet: share by tokens (underestimates decode's fixed cost,
            # corrected as soon as one decode-only step is measured).
            base = self.decode_step_baseline_s
            decode = t * step.num_decode_tokens / total if base is None else min(t, base)
            self.decode_busy_s += decode
            self.prefill_busy_s += t - decode
