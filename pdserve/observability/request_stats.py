"""What one finished request contributes to the router's metrics, read from its timeline. Pure.

Everything here is derived from the same `RequestTimeline` that `GET /debug/requests/{id}`
shows, so a metric and a timeline can be checked against each other exactly:

    ttft      RECEIVED → first output token at the router (`first_token_ns`)
    e2e       RECEIVED → FINISHED (finished requests only)
    tpot      (last token − first token) / (tokens − 1), finished requests with ≥ 2 tokens
    queue     RECEIVED → first RESERVED (disaggregated: the wait for a decode slot)
    prefill, transfer, handoff   `phases.handoff_phases` (last completed occurrence)

Retries, fallbacks and migrations are read from the `Reason` the flows put on RETRYING (and,
for the breaker, RECEIVED) transitions: an enum, never the detail text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.observability.phases import handoff_phases
from pdserve.protocol.request_state import Reason, Transition
from pdserve.protocol.request_state import RequestState as S

# The RECEIVED detail of a request the breaker sent colocated (router/flows/dispatcher.py).
BREAKER_DETAIL = "colocated: KV-path circuit breaker open"


class TimelineLike(Protocol):
    """The parts of `RequestTimeline` read here."""

    @property
    def mode(self) -> str: ...
    @property
    def history(self) -> Sequence[Transition]: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def first_token_ns(self) -> int | None: ...
    @property
    def last_token_ns(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class RequestStats:
    """Seconds and counts of one request; None / empty where it did not get that far."""

    ttft_s: float | None
    e2e_s: float | None
    tpot_s: float | None
    queue_s: float | None
    # "prefill", "transfer", "handoff" (and "reserve"), as `handoff_phases` computes them.
    phases: dict[str, float] = field(default_factory=dict)
    # One reason per RETRYING transition, in order.
    retries: tuple[str, ...] = ()
    fallbacks: tuple[str, ...] = ()
    num_migrations: int = 0


def request_stats(timeline: TimelineLike) -> RequestStats:
    """The stats of a timeline (normally a terminal one)."""
    history = timeline.history
    received = history[0].monotonic_ns
    first_token = timeline.first_token_ns
    ttft = None if first_token is None else (first_token - received) / 1e9
    finished = next((t.monotonic_ns for t in history if t.state is S.FINISHED), None)
    e2e = None if finished is None else (finished - received) / 1e9
    tpot = None
    last = timeline.last_token_ns
    n = timeline.num_output_tokens
    if finished is not None and first_token is not None and last is not None and n >= 2:
        tpot = (last - first_token) / 1e9 / (n - 1)
    reserved = next((t.monotonic_ns for t in history if t.state is S.RESERVED), None)
    queue = None if reserved is None else (reserved - received) / 1e9
    retries = tuple(
        t.reason.value for t in history if t.state is S.RETRYING and t.reason is not None
    )
    fallbacks = ["local_prefill"] * retries.count("local_prefill")
    if history[0].reason is Reason.BREAKER_OPEN:
        fallbacks.insert(0, "breaker_open")
    return RequestStats(
        ttft_s=ttft,
        e2e_s=e2e,
        tpot_s=tpot,
        queue_s=queue,
        phases=handoff_phases(history),
        retries=retries,
        fallbacks=tuple(fallbacks),
        num_migrations=retries.count("migration"),
    )
