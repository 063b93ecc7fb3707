"""OpenTelemetry spans of a finished request, when the `opentelemetry` package is installed.

One root span `pdserve.request` (RECEIVED to the terminal transition) per request, with a
child span per handoff phase the request completed (`queue`, `reserve`, `prefill`,
`transfer`, `handoff`, as `request_stats` and `phases` define them) and a `decode` child from
the first decode-side token to the end. Attributes: request id, mode, final state, output
tokens, retry reasons. Spans are built after the fact from the router's timeline with
explicit start and end times, so nothing runs on the request's path.

Optional by construction: `request_span_hook()` returns None, without importing anything of
OpenTelemetry, when the package is absent (the extra `pdserve[otel]` installs it). Like any
library, pdserve only uses the API (`trace.get_tracer`); the process that wants the spans
configures the SDK and its exporter (for example by starting the router under
`opentelemetry-instrument`), otherwise the API's default provider drops them.

Timestamps: OpenTelemetry wants epoch nanoseconds; each transition's monotonic stamp is put on
the wall clock through the RECEIVED transition (`wall + (mono - mono_received)`), so the spans
keep the monotonic durations even if the wall clock steps.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from pdserve.observability.phases import phase_bounds
from pdserve.observability.request_stats import request_stats
from pdserve.protocol.request_state import RequestState as S
from pdserve.protocol.request_state import RequestTimeline

TRACER_NAME = "pdserve.router"
SpanHook = Callable[[RequestTimeline], None]


def available() -> bool:
    """True when the OpenTelemetry API can be imported (checked without importing it)."""
    return importlib.util.find_spec("opentelemetry") is not None


def _phase_bounds(timeline: RequestTimeline) -> dict[str, tuple[int, int]]:
    """(start, end) monotonic ns of each completed phase (last completed occurrence)."""
    history = timeline.history
    bounds: dict[str, tuple[int, int]] = {}
    received = history[0].monotonic_ns
    reserved = next((t.monotonic_ns for t in history if t.state is S.RESERVED), None)
    if reserved is not None:
        bounds["queue"] = (received, reserved)
    bounds.update(phase_bounds(history))
    decoding = [t.monotonic_ns for t in history if t.state is S.DECODING]
    if decoding and timeline.done:
        bounds["decode"] = (decoding[-1], history[-1].monotonic_ns)
    return bounds


def emit_request_spans(tracer: Any, timeline: RequestTimeline) -> None:
    """Record the request's spans with `tracer` (an OpenTelemetry `Tracer`)."""
    from opentelemetry import trace

    history = timeline.history
    base_mono = history[0].monotonic_ns
    base_wall = int(history[0].wall_time_s * 1e9)

    def epoch(mono_ns: int) -> int:
        return base_wall + (mono_ns - base_mono)

    stats = request_stats(timeline)
    root = tracer.start_span(
        "pdserve.request",
        start_time=epoch(base_mono),
        attributes={
            "pdserve.request_id": timeline.request_id,
            "pdserve.mode": timeline.mode,
            "pdserve.state": timeline.state.name,
            "pdserve.num_output_tokens": timeline.num_output_tokens,
            "pdserve.retries": list(stats.retries),
        },
    )
    context = trace.set_span_in_context(root)
    for name, (start, end) in sorted(_phase_bounds(timeline).items(), key=lambda kv: kv[1]):
        span = tracer.start_span(f"pdserve.{name}", context=context, start_time=epoch(start))
        span.end(end_time=epoch(end))
    if timeline.state is S.FAILED:
        root.set_status(trace.Status(trace.StatusCode.ERROR, history[-1].detail))
    root.end(end_time=epoch(history[-1].monotonic_ns))


def request_span_hook(tracer_provider: Any = None) -> SpanHook | None:
    """A hook that records each finished request's spans; None when OpenTelemetry is absent.

    `tracer_provider` None: the global provider (what the process configured)."""
    if not available():
        return None
    from opentelemetry import trace

    tracer = trace.get_tracer(TRACER_NAME, tracer_provider=tracer_provider)

    def hook(timeline: RequestTimeline) -> None:
        emit_request_spans(tracer, timeline)

    return hook
