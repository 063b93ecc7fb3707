"""GET /debug/requests/{id}: one request's timeline, merged across the router and its workers.

The router's own transitions (`history`, on the router's monotonic clock) come first, as
`pdserve trace` reads them. Unless `?workers=0`, every worker of the pool is asked for its
events of the request (`GET /debug/requests/{id}` on the worker; suffixed worker-side ids
included); each answer is also a clock echo for that worker, added to the echoes of the
pool's health polls, and the request's own calls to the worker narrow that further
(`timeline_merge.call_bounds`: e.g. `prefill_start` came after PREFILLING, `prefill_end`
before PREFILLED), so the offset used is the tightest these prove
(`observability.clock_sync`). The events of all processes are then put
on the router's clock and sorted (`merged`), and `clocks` says which offset and error bound
each worker got. A worker that does not answer is listed in `clocks` with the error; its
events are missing, nothing else fails.
"""

from __future__ import annotations

import asyncio
import time

from pydantic import BaseModel

from pdserve.errors import RouterError
from pdserve.observability.clock_sync import ClockSync
from pdserve.observability.timeline_log import TimelineEvent
from pdserve.observability.timeline_merge import (
    MergedEvent,
    ProcessEvents,
    call_bounds,
    merge_events,
)
from pdserve.protocol.request_state import RequestTimeline
from pdserve.router.workers.client import WorkerClient
from pdserve.router.workers.pool import WorkerPool


class TransitionView(BaseModel):
    """One router transition."""

    state: str
    monotonic_ns: int
    wall_time_s: float
    detail: str


class ClockView(BaseModel):
    """How a worker's clock was aligned with the router's (or why it could not be)."""

    worker: str
    worker_id: str | None
    # Worker monotonic clock minus the router's, and the bound of its error.
    offset_ns: int | None
    error_ns: int | None
    num_events: int
    error: str | None = None


class TimelineView(BaseModel):
    """The whole answer."""

    request_id: str
    mode: str
    state: str
    history: list[TransitionView]
    num_output_tokens: int
    first_token_ns: int | None
    last_token_ns: int | None
    # Every process's events on the router's clock (`router_ns`); pydantic serializes the
    # dataclass as it is, field by field.
    merged: list[MergedEvent]
    clocks: list[ClockView]


async def _worker_events(
    client: WorkerClient, pool: WorkerPool, url: str, timeline: RequestTimeline
) -> tuple[ClockView, ProcessEvents | None]:
    request_id = timeline.request_id
    clock = pool.clock(url) or ClockSync()
    try:
        sent_ns = time.monotonic_ns()
        answer = await client.debug_events(url, request_id)
        received_ns = time.monotonic_ns()
    except RouterError as exc:
        return ClockView(
            worker=url, worker_id=None, offset_ns=None, error_ns=None, num_events=0, error=str(exc)
        ), None
    clock.add(sent_ns, answer.request_monotonic_ns, received_ns, remote_sent_ns=answer.monotonic_ns)
    events = [
        TimelineEvent(
            e.request_id, answer.worker_id, e.event, e.monotonic_ns, e.wall_time_s, e.detail
        )
        for e in answer.events
    ]
    # The request's own calls to this worker bound the offset too, and keep its events in
    # order with the router transitions around those calls.
    bounds = call_bounds(request_id, timeline.history, url, events)
    estimate = clock.estimate(*bounds)
    assert estimate is not None  # a sample was just added
    offset, error = estimate.offset_ns, (estimate.rtt_ns + 1) // 2
    view = ClockView(
        worker=url,
        worker_id=answer.worker_id,
        offset_ns=offset,
        error_ns=error,
        num_events=len(events),
    )
    return view, ProcessEvents(events, offset)


async def timeline_view(
    timeline: RequestTimeline, pool: WorkerPool, client: WorkerClient | None
) -> TimelineView:
    """The merged view of `timeline` (see the module docstring); `client` None: the router's
    transitions only."""
    rid = timeline.request_id
    router_events = [
        TimelineEvent(rid, "router", t.state.name, t.monotonic_ns, t.wall_time_s, t.detail)
        for t in timeline.history
    ]
    answers = (
        await asyncio.gather(*(_worker_events(client, pool, url, timeline) for url in pool.urls))
        if client is not None
        else []
    )
    merged = merge_events(router_events, [p for _, p in answers if p is not None])
    return TimelineView(
        request_id=rid,
        mode=timeline.mode,
        state=timeline.state.name,
        history=[
            TransitionView(
                state=t.state.name,
                monotonic_ns=t.monotonic_ns,
                wall_time_s=t.wall_time_s,
                detail=t.detail,
            )
            for t in timeline.history
        ],
        num_output_tokens=timeline.num_output_tokens,
        first_token_ns=timeline.first_token_ns,
        last_token_ns=timeline.last_token_ns,
        merged=merged,
        clocks=[view for view, _ in answers],
    )
