"""Timeline events of one process: a bounded ring of recent requests and JSON log lines.

Every process (router, each worker) records what it did for a request as `TimelineEvent`s,
stamped with its own `time.monotonic_ns()` and wall clock. Each event is also written as one
JSON object per line on the logger `pdserve.timeline` (INFO), so a log shipper can rebuild a
request's timeline without asking the processes. The ring keeps the events of the last
`max_requests` requests; older requests are evicted whole, oldest first, so memory is bounded
whatever the traffic.

A worker-side request id may carry a suffix (`.r1` for a re-prefill, `.m2` for a migration):
`events_for(request_id)` returns the router request's events under every suffix.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass

LOGGER_NAME = "pdserve.timeline"
log = logging.getLogger(LOGGER_NAME)


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One thing a process did for a request."""

    request_id: str
    # "router" or the worker's id.
    process: str
    # A router state name (RECEIVED, PREFILLED, ...) or a worker event (prefill_start, ...).
    event: str
    monotonic_ns: int
    wall_time_s: float
    detail: str = ""

    def to_json(self) -> str:
        """One log line."""
        return json.dumps(asdict(self), separators=(",", ":"))


def emit(event: TimelineEvent) -> None:
    """Write the event as a JSON log line (cheap when the logger is disabled)."""
    if log.isEnabledFor(logging.INFO):
        log.info("%s", event.to_json())


class EventRing:
    """Events of the last `max_requests` requests of one process."""

    def __init__(self, process: str, max_requests: int = 1000) -> None:
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.process = process
        self.max_requests = max_requests
        self._events: OrderedDict[str, list[TimelineEvent]] = OrderedDict()

    def record(self, request_id: str, event: str, detail: str = "") -> TimelineEvent:
        """Stamp, keep and log one event; returns it."""
        item = TimelineEvent(
            request_id, self.process, event, time.monotonic_ns(), time.time(), detail
        )
        self.add(item)
        emit(item)
        return item

    def add(self, item: TimelineEvent) -> None:
        """Keep an already stamped event (no log line)."""
        events = self._events.get(item.request_id)
        if events is None:
            events = self._events[item.request_id] = []
            while len(self._events) > self.max_requests:
                self._events.popitem(last=False)
        events.append(item)

    def events_for(self, request_id: str) -> list[TimelineEvent]:
        """The request's events, its suffixed ids (`id.r1`, `id.m2`) included, in time order."""
        prefix = request_id + "."
        found = [
            e
            for rid, events in self._events.items()
            if rid == request_id or rid.startswith(prefix)
            for e in events
        ]
        return sorted(found, key=lambda e: e.monotonic_ns)

    def __len__(self) -> int:
        return len(self._events)
