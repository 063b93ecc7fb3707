"""One request's events from several processes, on the router's clock, in order. Pure.

Each process stamps its events with its own monotonic clock. A worker's events are moved to
the router's clock with the offset the router estimated for that worker (`clock_sync`:
worker clock minus router clock), then every event is sorted by that common time. Ties keep
the router's event first and otherwise each process's own order (the sort is stable), so a
process's events never swap among themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.observability.timeline_log import TimelineEvent
from pdserve.protocol.request_state import RequestState as S
from pdserve.protocol.request_state import Transition


@dataclass(frozen=True, slots=True)
class MergedEvent:
    """An event of some process, placed on the router's clock."""

    process: str
    # The id the process knew the request by (a worker's may carry `.rN` / `.mN`).
    request_id: str
    event: str
    # Router's monotonic clock, nanoseconds (the process's own for the router itself).
    router_ns: int
    # The process's own monotonic clock.
    monotonic_ns: int
    wall_time_s: float
    detail: str


@dataclass(frozen=True, slots=True)
class ProcessEvents:
    """One process's events and its clock offset (its clock minus the router's)."""

    events: Sequence[TimelineEvent]
    offset_ns: int


def merge_events(
    router: Sequence[TimelineEvent], workers: Sequence[ProcessEvents]
) -> list[MergedEvent]:
    """Every event on the router's clock, sorted by it (see the module docstring)."""
    merged = [
        MergedEvent(
            e.process, e.request_id, e.event, e.monotonic_ns, e.monotonic_ns, e.wall_time_s,
            e.detail,
        )
        for e in router
    ]  # fmt: skip
    for process in workers:
        merged += [
            MergedEvent(
                e.process,
                e.request_id,
                e.event,
                e.monotonic_ns - process.offset_ns,
                e.monotonic_ns,
                e.wall_time_s,
                e.detail,
            )
            for e in sorted(process.events, key=lambda e: e.monotonic_ns)
        ]
    return sorted(merged, key=lambda e: e.router_ns)


def call_bounds(
    request_id: str,
    history: Sequence[Transition],
    worker_url: str,
    events: Sequence[TimelineEvent],
) -> tuple[int | None, int | None]:
    """Bounds on a worker's clock offset (its clock minus the router's) that the request's own
    calls to it prove: (low, high), either None when no call qualifies.

    A worker event caused by a router call happens after the router stamped the transition
    before the call (`offset <= worker_ns - router_ns`); one the router waited for happens
    before the transition stamped after the answer (`offset >= worker_ns - router_ns`). Only
    pairs that hold whatever failed are used: the first attempt's ids (no `.rN` suffix), the
    first ROUTED / PREFILLING / TRANSFERRING, an answer bound only when the transition right
    after the call is its success, and the decode stream (or the colocated `/generate` call)
    only when nothing was retried. The bounds make the merge keep exactly those pairs in order.
    """
    first: dict[str, TimelineEvent] = {}
    for e in sorted(events, key=lambda e: e.monotonic_ns):
        if e.request_id == request_id:
            first.setdefault(e.event, e)
    lows: list[int] = []
    highs: list[int] = []

    def after(event: str, router_ns: int) -> None:
        if event in first:
            highs.append(first[event].monotonic_ns - router_ns)

    def before(event: str, router_ns: int) -> None:
        if event in first:
            lows.append(first[event].monotonic_ns - router_ns)

    def following(index: int) -> Transition | None:
        return history[index + 1] if index + 1 < len(history) else None

    for i, t in enumerate(history):
        nxt = following(i)
        if t.state is S.ROUTED and t.detail.startswith(f"decode={worker_url} "):
            after("reserved", t.monotonic_ns)
            if nxt is not None and nxt.state is S.RESERVED:
                before("reserved", nxt.monotonic_ns)
            break
        if t.state is S.ROUTED:
            break
    for i, t in enumerate(history):
        if t.state is S.PREFILLING:
            if t.detail == worker_url:
                after("prefill_start", t.monotonic_ns)
                nxt = following(i)
                if nxt is not None and nxt.state is S.PREFILLED:
                    before("prefill_end", nxt.monotonic_ns)
            break
    if not any(t.state is S.RETRYING for t in history):
        at = {t.state: t for t in history}
        routed = at.get(S.ROUTED)
        done = at.get(S.FINISHED)
        if routed is not None and routed.detail == worker_url and S.RESERVED not in at:
            # Colocated: the one /generate call went to this worker.
            after("generate_start", routed.monotonic_ns)
            if S.DECODING in at:
                before("first_token", at[S.DECODING].monotonic_ns)
            if done is not None and not done.detail.startswith("router:"):
                before("finished", done.monotonic_ns)
        transferring = at.get(S.TRANSFERRING)
        if transferring is not None and transferring.detail == worker_url:
            after("decode_start", transferring.monotonic_ns)
            for event, state in (("decode_start", S.COMMITTED), ("first_token", S.DECODING)):
                if state in at:
                    before(event, at[state].monotonic_ns)
            if done is not None and not done.detail.startswith("router:"):
                before("finished", done.monotonic_ns)
    return (max(lows) if lows else None), (min(highs) if highs else None)
