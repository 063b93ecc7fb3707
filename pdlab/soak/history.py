"""A soak's history: what was sent and how each request ended, what the nemesis did, and what
the cluster held once quiet. Written as JSON lines (one record per line, `type` first), read
back into the same dataclasses, so the checker runs on a file as well as on a live run.

    {"type": "meta", ...}         the run's parameters (seed, duration, rate, nemesis, targets)
    {"type": "request", ...}      one per request sent, in either phase (fault-free or soak)
    {"type": "fault", ...}        one per planned fault, applied or skipped, with its times
    {"type": "quiescence", ...}   per worker pinned blocks (idle and after), processes left

Times are seconds since the phase's load started (the soak's faults on the soak's clock).
Each request carries what it should have been (the reference tokens and text, or the `param`
its 400 must name), so a history needs nothing else to be judged. Pure: no files here beyond
turning records into lines and back.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from pdserve.advise.client import Ending


class Phase(enum.StrEnum):
    """Which part of the run a request belongs to."""

    FAULT_FREE = "fault_free"
    SOAK = "soak"


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request: what it was, what it should have been, how it ended."""

    phase: Phase
    index: int
    api: str
    stream: bool
    deadline_s: float
    session: str | None = None
    turn: int = 0
    malformed: str | None = None
    disconnect_after: int | None = None
    expected_token_ids: tuple[int, ...] = ()
    expected_text: str = ""
    # Other fault-free outputs of the same request (the request computed alone, when what was
    # received differs from the batched reference: the engine's numerics depend on the batch,
    # so at a near-tie of two tokens either branch is a correct output), with their texts.
    alternative_token_ids: tuple[tuple[int, ...], ...] = ()
    alternative_texts: tuple[str, ...] = ()
    # The `param` a malformed request's 400 must name (None: none, e.g. malformed JSON).
    expected_param: str | None = None
    start_s: float = 0.0
    end_s: float = 0.0
    ttft_s: float | None = None
    # Routers tried, in order; the last one is the request's own.
    routers: tuple[str, ...] = ()
    status: int | None = None
    request_id: str | None = None
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str | None = None
    ending: Ending = Ending.COMPLETE
    error_type: str | None = None
    error_param: str | None = None
    error_message: str | None = None
    # Workers the router's timeline names for this request (by name).
    workers: tuple[str, ...] = ()

    @property
    def router(self) -> str | None:
        """The router that took the request (the last one tried)."""
        return self.routers[-1] if self.routers else None

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, slots=True)
class FaultRecord:
    """One fault of the nemesis as it happened."""

    index: int
    kind: str
    targets: tuple[str, ...]
    planned_at_s: float
    applied: bool
    start_s: float | None = None
    # When it was over: healed (pause, partition, transfer plan cleared) or the process back.
    end_s: float | None = None
    # Why it was skipped, or what it did (the PID killed, the rules posted).
    detail: str = ""


@dataclass(frozen=True, slots=True)
class WorkerQuiescence:
    """One worker once the load and the faults stopped and a lease TTL passed."""

    name: str
    reachable: bool
    pinned_idle: int = 0
    pinned_after: int = 0
    num_running: int = 0
    num_waiting: int = 0


@dataclass(frozen=True, slots=True)
class Quiescence:
    """The cluster at rest, and after it stopped."""

    workers: tuple[WorkerQuiescence, ...] = ()
    # "name pid N" of every process still alive after the cluster stopped.
    processes_left: tuple[str, ...] = ()
    # Children the supervisor gave up on, with its reason.
    given_up: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SoakTargets:
    """What a soak must show (issue 16's targets)."""

    min_availability: float = 0.99


@dataclass(frozen=True, slots=True)
class SoakMeta:
    """The run's parameters: enough to replay it (`pdserve chaos --soak ... --seed`)."""

    seed: int
    duration_s: float
    rate: float
    nemesis: tuple[str, ...]
    fault_interval_s: float
    fault_free_s: float
    # None: workers ran in network namespaces; else why they did not (partition not run).
    netns_unavailable: str | None = None
    command: str = ""
    targets: SoakTargets = field(default_factory=SoakTargets)


@dataclass(slots=True)
class History:
    """Everything a soak recorded."""

    meta: SoakMeta
    requests: list[RequestRecord] = field(default_factory=list)
    faults: list[FaultRecord] = field(default_factory=list)
    quiescence: Quiescence = field(default_factory=Quiescence)


def to_lines(history: History) -> Iterable[str]:
    """The history as JSON lines."""
    yield _line("meta", history.meta)
    for request in history.requests:
        yield _line("request", request)
    for fault in history.faults:
        yield _line("fault", fault)
    yield _line("quiescence", history.quiescence)


def from_lines(lines: Iterable[str]) -> History:
    """Read back what `to_lines` wrote; ValueError naming the line that does not parse."""
    meta: SoakMeta | None = None
    history: History | None = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            kind = obj.pop("type")
            if kind == "meta":
                meta = _build(SoakMeta, obj)
                history = History(meta)
            elif history is None:
                raise ValueError("the first record must be the meta record")
            elif kind == "request":
                history.requests.append(_build(RequestRecord, obj))
            elif kind == "fault":
                history.faults.append(_build(FaultRecord, obj))
            elif kind == "quiescence":
                history.quiescence = _build(Quiescence, obj)
            else:
                raise ValueError(f"unknown record type {kind!r}")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"history line {number}: {exc}") from None
    if history is None:
        raise ValueError("the history is empty")
    return history


def _line(kind: str, record: object) -> str:
    return json.dumps({"type": kind, **dataclasses.asdict(record)})  # type: ignore[call-overload]


T = TypeVar("T")
_NESTED: dict[tuple[type, str], type] = {
    (SoakMeta, "targets"): SoakTargets,
    (Quiescence, "workers"): WorkerQuiescence,
}
_ENUMS: dict[str, type[enum.StrEnum]] = {"phase": Phase, "ending": Ending}


def _build(cls: type[T], obj: dict[str, Any]) -> T:
    """`cls` from its `asdict` form: lists back to tuples, nested records and enums rebuilt."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = set(obj) - names
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    values: dict[str, Any] = {}
    for name, value in obj.items():
        nested = _NESTED.get((cls, name))
        if nested is not None and isinstance(value, dict):
            value = _build(nested, value)
        elif nested is not None and isinstance(value, list):
            value = tuple(_build(nested, v) for v in value)
        elif isinstance(value, list):
            value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        elif name in _ENUMS:
            value = _ENUMS[name](value)
        values[name] = value
    return cls(**values)
