"""A request's state machine on the router, as one transition table, and its timeline.

Disaggregated life cycle (DESIGN.md):

    RECEIVED → ROUTED → RESERVED → PREFILLING → PREFILLED → TRANSFERRING → COMMITTED
      → DECODING → FINISHED
    any live state → RETRYING (→ RETRYING: the next recovery step) → an earlier state (ROUTED,
      RESERVED, PREFILLING), or → FAILED. RECEIVED → RETRYING too: a recovery may begin
      before anything was routed (no prefill worker is usable: the decode side prefills).

Colocated life cycle: RECEIVED → ROUTED → DECODING (the worker generates everything) → FINISHED.

PREFILLED → FINISHED is allowed because the first token may already end the request
(max_tokens == 1, EOS). TRANSFERRING starts when the router asks the decode worker to stream
(the worker waits for verified KV); COMMITTED is recorded when the decode worker accepts the
stream, DECODING at its first token.

Every RETRYING transition carries a `Reason` (an enum: metrics and policies read it, never the
detail text, which is for people).

Pure: no I/O. An illegal transition raises `IllegalRequestTransition` and changes nothing.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.errors import IllegalRequestTransition


class RequestState(enum.Enum):
    """Where a request is in its life cycle."""

    RECEIVED = "received"
    ROUTED = "routed"
    RESERVED = "reserved"
    PREFILLING = "prefilling"
    PREFILLED = "prefilled"
    TRANSFERRING = "transferring"
    COMMITTED = "committed"
    DECODING = "decoding"
    FINISHED = "finished"
    RETRYING = "retrying"
    FAILED = "failed"


class Reason(enum.Enum):
    """Why a request left its path (a RETRYING transition; the breaker's on RECEIVED)."""

    # A decode worker refused the reservation (full, or unreachable): the next one is tried.
    RESERVE_REFUSED = "reserve_refused"
    # Colocated: a worker refused /generate before its first token: the next one is tried.
    WORKER_REFUSED = "worker_refused"
    # A prefill attempt failed on the prefill side: another prefill worker is tried.
    PREFILL_FAILED = "prefill_failed"
    # The handoff failed before the decode side committed (transfer, KV check, reservation
    # lost): a fresh reservation and prefill elsewhere.
    REPREFILL = "reprefill"
    # No prefill worker could do it: the decode side recomputes the prompt itself.
    LOCAL_PREFILL = "local_prefill"
    # The decode side died mid-stream: another decode worker resumes after the sent tokens.
    MIGRATION = "migration"
    # A local prefill or migration stream failed: the next decode worker is tried.
    RESUME_FAILED = "resume_failed"
    # The KV-path circuit breaker was open: the request runs colocated (RECEIVED's reason).
    BREAKER_OPEN = "breaker_open"


S = RequestState
TERMINAL: frozenset[RequestState] = frozenset({S.FINISHED, S.FAILED})
# Every allowed transition, in one place. FAILED is reachable from every live state.
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.RECEIVED: frozenset({S.ROUTED, S.RETRYING, S.FAILED}),
    S.ROUTED: frozenset({S.RESERVED, S.DECODING, S.RETRYING, S.FAILED}),
    S.RESERVED: frozenset({S.PREFILLING, S.RETRYING, S.FAILED}),
    S.PREFILLING: frozenset({S.PREFILLED, S.RETRYING, S.FAILED}),
    S.PREFILLED: frozenset({S.TRANSFERRING, S.FINISHED, S.RETRYING, S.FAILED}),
    S.TRANSFERRING: frozenset({S.COMMITTED, S.RETRYING, S.FAILED}),
    S.COMMITTED: frozenset({S.DECODING, S.FINISHED, S.RETRYING, S.FAILED}),
    S.DECODING: frozenset({S.FINISHED, S.RETRYING, S.FAILED}),
    # RETRYING → RETRYING: one recovery step gave up and the next one begins.
    S.RETRYING: frozenset({S.RETRYING, S.ROUTED, S.RESERVED, S.PREFILLING, S.FAILED}),
    S.FINISHED: frozenset(),
    S.FAILED: frozenset(),
}


def can_transition(current: RequestState, target: RequestState) -> bool:
    """True when the table allows `current -> target`."""
    return target in TRANSITIONS[current]


@dataclass(frozen=True, slots=True)
class Transition:
    """One recorded state change."""

    state: RequestState
    monotonic_ns: int
    wall_time_s: float
    # Why, for people: the worker chosen, the error; "" when nothing to add.
    detail: str = ""
    # Why, for programs: set on every RETRYING transition (and a breaker fallback).
    reason: Reason | None = None


@dataclass(slots=True)
class RequestTimeline:
    """A request's current state and every transition it went through, with timestamps."""

    request_id: str
    mode: str
    history: list[Transition] = field(default_factory=list)
    # Told of every transition after it is recorded (JSON log lines, OpenTelemetry); must not
    # raise. Not called for the transitions given to the constructor.
    on_transition: Callable[[RequestTimeline, Transition], None] | None = None
    # Output tokens as they reached the router (see `record_tokens`).
    num_output_tokens: int = 0
    first_token_ns: int | None = None
    last_token_ns: int | None = None

    def __post_init__(self) -> None:
        if not self.history:
            self.history.append(Transition(S.RECEIVED, time.monotonic_ns(), time.time()))

    @property
    def state(self) -> RequestState:
        """The current state (the last transition's)."""
        return self.history[-1].state

    @property
    def done(self) -> bool:
        """True once FINISHED or FAILED."""
        return self.state in TERMINAL

    def advance(self, target: RequestState, detail: str = "", reason: Reason | None = None) -> None:
        """Move to `target`; raises IllegalRequestTransition (state unchanged) if not allowed,
        or ValueError for a RETRYING without its reason."""
        if not can_transition(self.state, target):
            raise IllegalRequestTransition(self.request_id, self.state.name, target.name)
        if target is S.RETRYING and reason is None:
            raise ValueError(f"request {self.request_id}: RETRYING needs a Reason")
        transition = Transition(target, time.monotonic_ns(), time.time(), detail, reason)
        self.history.append(transition)
        if self.on_transition is not None:
            self.on_transition(self, transition)

    def record_tokens(self, num_tokens: int, now_ns: int) -> float | None:
        """`num_tokens` output tokens arrived at `now_ns` (monotonic); returns the seconds per
        token since the previous arrival (the inter-token latency of each of them), None for
        the first tokens of the request or an empty chunk."""
        if num_tokens <= 0:
            return None
        previous = self.last_token_ns
        if self.first_token_ns is None:
            self.first_token_ns = now_ns
        self.last_token_ns = now_ns
        self.num_output_tokens += num_tokens
        return None if previous is None else (now_ns - previous) / 1e9 / num_tokens

    def retry(self, reason: Reason, detail: str = "") -> None:
        """Record a recovery step (RETRYING with its reason)."""
        self.advance(S.RETRYING, detail, reason)

    def fail(self, detail: str) -> None:
        """Move to FAILED unless already terminal (cleanup paths call this unconditionally)."""
        if not self.done:
            self.advance(S.FAILED, detail)

    def first_ns(self, state: RequestState) -> int | None:
        """Monotonic ns of the first entry into `state`, None if never entered."""
        for t in self.history:
            if t.state is state:
                return t.monotonic_ns
        return None

    def elapsed_s(self, state: RequestState) -> float | None:
        """Seconds from RECEIVED to the first entry into `state`."""
        ns = self.first_ns(state)
        return None if ns is None else (ns - self.history[0].monotonic_ns) / 1e9
