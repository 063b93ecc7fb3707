"""Which flow a new request takes, and the timelines of recent requests.

The mode is read once, when a request begins: `set_mode` (POST /admin/mode) only affects
requests that begin afterwards, so in-flight requests finish in the mode they started in. The
timelines of the last `max_timelines` requests are kept for /debug/requests/{id}.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from pdserve.router.config import Mode
from pdserve.router.flow import Flow
from pdserve.router.state import RequestTimeline


class Dispatcher:
    """Holds the current mode, the flows, and recent timelines."""

    def __init__(self, mode: Mode, flows: Mapping[Mode, Flow], max_timelines: int = 1000) -> None:
        self._mode = mode
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
        timeline = RequestTimeline(request_id, self._mode)
        self._timelines[request_id] = timeline
        while len(self._timelines) > self._max_timelines:
            self._timelines.popitem(last=False)
        return self._flows[self._mode], timeline

    def timeline(self, request_id: str) -> RequestTimeline | None:
        """A recent request's timeline, None if unknown or evicted."""
        return self._timelines.get(request_id)
