"""The worker's observation and admin bodies: its request timelines, its KV event stream, and
the fault plan of tests. Split from `worker_api.py` (the serving calls) by concern; the same
rules hold: every model forbids unknown fields and refuses NaN and infinities.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pdserve.protocol.worker_api import Role, WireModel


class WorkerEventModel(WireModel):
    """One timeline event of a worker (see `observability.timeline_log.TimelineEvent`)."""

    request_id: str
    event: str
    # The worker's monotonic clock, nanoseconds; wall clock, seconds since the epoch.
    monotonic_ns: int
    wall_time_s: float
    detail: str = ""


class WorkerEvents(WireModel):
    """GET /debug/requests/{id}: the worker's events for a router request id (suffixes
    `.rN`, `.mN` included), with its clocks read as it answered."""

    worker_id: str
    role: Role
    # The worker's monotonic clock when the call arrived and as it answered (a clock echo).
    request_monotonic_ns: int
    monotonic_ns: int
    wall_time_s: float
    events: list[WorkerEventModel]


class KVEventsRequest(WireModel):
    """POST /kv_events: follow this worker's prefix cache (blocks stored and evicted)."""

    # Resume after this event of this epoch. None, another epoch (the worker restarted) or an
    # event the worker no longer has (a gap): the stream starts with a snapshot instead.
    after_seq: int | None = Field(default=None, ge=0)
    epoch: str | None = None


KVEventBatchKind = Literal["snapshot", "stored", "evicted", "cleared", "heartbeat"]


class KVEventBatch(WireModel):
    """One line of a KV event stream (see `engine.kv_events`).

    `snapshot`: every hash cached now, as of event `seq` (replace what you had); `stored`,
    `evicted`, `cleared`: event number `seq`, to apply only right after `seq - 1`;
    `heartbeat`: nothing happened, the newest event is still `seq` (sent after a second of
    silence, so a silent stream means a silent worker).
    """

    epoch: str
    seq: int
    kind: KVEventBatchKind
    # Chained block hashes (unsigned 64-bit).
    block_hashes: list[int] = Field(default_factory=list)


class FaultPlanBody(WireModel):
    """POST /admin/faults: the fault plan that replaces the current one (tests only)."""

    # `pdserve.faults` rules, `SITE:ACTION[:key=value,...]`, applied in order.
    rules: list[str]
    seed: int = 0


class InjectedFaultModel(WireModel):
    """One fault that fired: its site, the 0-based hit index there, and the action."""

    site: str
    hit: int
    action: str


class FaultState(WireModel):
    """GET /admin/faults: the plan and what it injected since it was set."""

    rules: list[str]
    seed: int
    # The latest injections (at most pdserve.faults.RECORD_LIMIT), and how many there were.
    injected: list[InjectedFaultModel]
    num_injected: int = 0
    # Hits counted per site since the plan was set.
    hits: dict[str, int]
