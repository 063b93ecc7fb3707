"""The phases of one request's handoff, measured from its router timeline. Pure.

    reserve    ROUTED → RESERVED        (the decode slot and its blocks)
    prefill    PREFILLING → PREFILLED   (the prefill worker's forward, first token)
    transfer   TRANSFERRING → COMMITTED (KV on the wire and verified on the decode side)
    handoff    PREFILLED → DECODING     (first token out to the next one: the gap a user feels)

Each phase is taken from its last completed occurrence, so a retried request reports the
attempt that succeeded; a phase the request never completed is absent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pdserve.protocol.request_state import RequestState as S

PHASES: dict[str, tuple[S, S]] = {
    "reserve": (S.ROUTED, S.RESERVED),
    "prefill": (S.PREFILLING, S.PREFILLED),
    "transfer": (S.TRANSFERRING, S.COMMITTED),
    "handoff": (S.PREFILLED, S.DECODING),
}


class _Transition(Protocol):
    @property
    def state(self) -> S: ...
    @property
    def monotonic_ns(self) -> int: ...


def phase_bounds(history: Sequence[_Transition]) -> dict[str, tuple[int, int]]:
    """(start, end) monotonic ns of each phase, its last completed occurrence."""
    bounds: dict[str, tuple[int, int]] = {}
    for name, (start, end) in PHASES.items():
        began: int | None = None
        for t in history:
            if t.state is start:
                began = t.monotonic_ns
            elif t.state is end and began is not None:
                bounds[name] = (began, t.monotonic_ns)
                began = None
    return bounds


def handoff_phases(history: Sequence[_Transition]) -> dict[str, float]:
    """Seconds per phase (see the module docstring) from a timeline's transitions."""
    return {name: (end - start) / 1e9 for name, (start, end) in phase_bounds(history).items()}
