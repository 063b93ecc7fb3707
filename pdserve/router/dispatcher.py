"""Which flow a new request takes, and the timelines of recent requests.

The mode is read once, when a request begins: `set_mode` (POST /admin/mode) only affects
requests that begin afterwards, so in-flight requests finish in the mode they started in.
The configured mode is the operator's; the circuit breaker may send a request colocated
instead while the KV path is failing (its timeline's first transition says so). The
timelines of the last `max_timelines` requests are kept for /debug/requests/{id}.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping

from pdserve.router.breaker import BreakerState, CircuitBreaker
from pdserve.router.config import Mode
from pdserve.router.flow import Flow
from pdserve.router.state import RequestState, RequestTimeline, Transition

log = logging.getLogger(__name__)


class Dispatcher:
    """Holds the current mode, the flows, and recent timelines."""

    def __init__(
        self,
        mode: Mode,
        flows: Mapping[Mode, Flow],
        max_timelines: int = 1000,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        self._mode = mode
        self.breaker = breaker
        self._flows = dict(flows)
        self._timelines: OrderedDict[str, RequestTimeline] = OrderedDict()
        self._max_timelines = max_timelines

    @property
    def mode(self) -> Mode:
        """The mode new requests start in."""
        return self._mode

    def set_mode(self, mode: Mode) -> Mode:
        """Switch the mode for requests that begin from now on; returns the previous one."""
        previous, self._mode = self._mode, mode
        return previous

    def begin(self, request_id: str) -> tuple[Flow, RequestTimeline]:
        """The flow for a new request (bound to the current mode) and its fresh timeline."""
        mode = self._mode
        history: list[Transition] = []
        if mode == "disagg" and self.breaker is not None and not self.breaker.admit():
            mode = "colocated"
            detail = "colocated: KV-path circuit breaker open"
            history.append(
                Transition(RequestState.RECEIVED, time.monotonic_ns(), time.time(), detail)
            )
        timeline = RequestTimeline(request_id, mode, history)
        self._timelines[request_id] = timeline
        while len(self._timelines) > self._max_timelines:
            self._timelines.popitem(last=False)
        return self._flows[mode], timeline

    @property
    def effective_mode(self) -> Mode:
        """The mode a new request gets now (colocated while the breaker is open)."""
        breaker = self.breaker
        if self._mode == "disagg" and breaker is not None and breaker.state is BreakerState.OPEN:
            return "colocated"
        return self._mode

    def record_kv_outcome(self, ok: bool, reason: str) -> None:
        """One handoff's outcome, for the breaker; logs each breaker transition."""
        if self.breaker is None:
            return
        before = len(self.breaker.transitions)
        self.breaker.record(ok, reason)
        for t in list(self.breaker.transitions)[before:]:
            log.warning("circuit breaker %s -> %s: %s", t.source.value, t.target.value, t.reason)

    def timeline(self, request_id: str) -> RequestTimeline | None:
        """A recent request's timeline, None if unknown or evicted."""
        return self._timelines.get(request_id)
