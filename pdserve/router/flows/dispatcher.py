"""Which flow a new request takes, and the timelines of recent requests.

The mode is read once, when a request begins: `set_mode` (POST /admin/mode) only affects
requests that begin afterwards, so in-flight requests finish in the mode they started in.
The configured mode is the operator's; the circuit breaker may send a request colocated
instead while the KV path is failing (its timeline's first transition says so). The
timelines of the last `max_timelines` requests are kept for /debug/requests/{id}.

Observation: every transition is written as a JSON log line (`pdserve.timeline`); the flow
handed out is wrapped so that each token chunk is stamped on the timeline as it arrives
(TTFT, inter-token latency) and, once the flow has ended (finished, failed or closed), the
whole timeline is given to the metrics. Ending is the right moment, not the FINISHED
transition: a flow records FINISHED just before it yields the last tokens.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Mapping

from pdserve.observability.request_stats import BREAKER_DETAIL, request_stats
from pdserve.observability.timeline_log import TimelineEvent, emit
from pdserve.protocol.request_state import Reason, RequestState, RequestTimeline, Transition
from pdserve.router.config import Mode
from pdserve.router.flows import progress
from pdserve.router.flows.flow import Flow, FlowRequest, TokenChunk
from pdserve.router.metrics import RouterMetrics
from pdserve.router.mode.breaker import BreakerState, BreakerTransition, CircuitBreaker
from pdserve.router.mode.live_monitor import LiveMonitor

log = logging.getLogger(__name__)


class Dispatcher:
    """Holds the current mode, the flows, and recent timelines."""

    def __init__(
        self,
        mode: Mode,
        flows: Mapping[Mode, Flow],
        max_timelines: int = 1000,
        breaker: CircuitBreaker | None = None,
        metrics: RouterMetrics | None = None,
        span_hook: Callable[[RequestTimeline], None] | None = None,
        monitor: LiveMonitor | None = None,
    ) -> None:
        self._mode = mode
        # Decode TPOT with / without prefill and SLO outcomes (None: not measured).
        self.monitor = monitor
        self.breaker = breaker
        if breaker is not None:
            breaker.on_transition = _log_breaker
        # None: no token stamps and no per-request metrics (JSON log lines still go out).
        self.metrics = metrics
        # Told of every request whose flow ended (OpenTelemetry spans); None: nothing.
        self.span_hook = span_hook
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
            history.append(
                Transition(
                    RequestState.RECEIVED,
                    time.monotonic_ns(),
                    time.time(),
                    BREAKER_DETAIL,
                    Reason.BREAKER_OPEN,
                )
            )
        timeline = RequestTimeline(request_id, mode, history, on_transition=_log_transition)
        _log_transition(timeline, timeline.history[0])
        self._timelines[request_id] = timeline
        while len(self._timelines) > self._max_timelines:
            self._timelines.popitem(last=False)
        flow = self._flows[mode]
        if self.metrics is None and self.span_hook is None and self.monitor is None:
            return flow, timeline
        return _ObservedFlow(flow, self.metrics, self.span_hook, self.monitor), timeline

    @property
    def effective_mode(self) -> Mode:
        """The mode a new request gets now (colocated while the breaker is open)."""
        breaker = self.breaker
        if self._mode == "disagg" and breaker is not None and breaker.state is BreakerState.OPEN:
            return "colocated"
        return self._mode

    def record_kv_outcome(self, ok: bool, reason: str) -> None:
        """One handoff's outcome, for the breaker (which logs each of its transitions)."""
        if self.breaker is not None:
            self.breaker.record(ok, reason)

    def timeline(self, request_id: str) -> RequestTimeline | None:
        """A recent request's timeline, None if unknown or evicted."""
        return self._timelines.get(request_id)


def _log_breaker(t: BreakerTransition) -> None:
    log.warning("circuit breaker %s -> %s: %s", t.source.value, t.target.value, t.reason)


def _log_transition(timeline: RequestTimeline, transition: Transition) -> None:
    emit(
        TimelineEvent(
            timeline.request_id,
            "router",
            transition.state.name,
            transition.monotonic_ns,
            transition.wall_time_s,
            transition.detail,
        )
    )


class _ObservedFlow:
    """A flow whose chunks are stamped on the timeline and whose end feeds the metrics."""

    def __init__(
        self,
        flow: Flow,
        metrics: RouterMetrics | None,
        span_hook: Callable[[RequestTimeline], None] | None,
        monitor: LiveMonitor | None = None,
    ) -> None:
        self._flow = flow
        self._metrics = metrics
        self._span_hook = span_hook
        self._monitor = monitor

    async def stream(self, request: FlowRequest) -> AsyncGenerator[TokenChunk, None]:
        timeline = request.timeline
        monitor = self._monitor
        tracker = (
            None
            if monitor is None
            else monitor.begin(len(request.prompt_token_ids), request.sampling.max_tokens)
        )
        try:
            async with contextlib.aclosing(self._flow.stream(request)) as chunks:
                async for chunk in chunks:
                    n = len(chunk.token_ids)
                    gap = progress.tokens(timeline, n, time.monotonic_ns())
                    if gap is not None and self._metrics is not None:
                        self._metrics.observe_itl(gap, n)
                    if monitor is not None and tracker is not None:
                        monitor.chunk(tracker, chunk.step, gap, n)
                    yield chunk
        finally:
            stats = request_stats(timeline)
            if self._metrics is not None:
                self._metrics.observe_request(stats)
            if monitor is not None and tracker is not None:
                monitor.end(tracker, stats, timeline.state is RequestState.FINISHED)
            if self._span_hook is not None:
                try:
                    self._span_hook(timeline)
                except Exception:  # an exporter's bug must not fail a served request
                    log.exception("span hook failed for request %s", timeline.request_id)
