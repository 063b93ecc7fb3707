"""OpenTelemetry spans per phase, checked with the SDK's in-memory exporter (skipped when the
optional `otel` extra is not installed)."""

from __future__ import annotations

import pytest

from pdserve.observability import otel
from pdserve.protocol.request_state import RequestState, RequestTimeline, Transition

MS = 1_000_000


def _timeline() -> RequestTimeline:
    states = [
        ("RECEIVED", 0, ""),
        ("ROUTED", 1 * MS, ""),
        ("RESERVED", 2 * MS, ""),
        ("PREFILLING", 2 * MS, ""),
        ("PREFILLED", 12 * MS, ""),
        ("TRANSFERRING", 12 * MS, ""),
        ("COMMITTED", 16 * MS, ""),
        ("DECODING", 17 * MS, ""),
        ("FINISHED", 40 * MS, "length"),
    ]
    history = [
        Transition(RequestState[s], 5_000 * MS + ns, 100.0 + ns / 1e9, d) for s, ns, d in states
    ]
    timeline = RequestTimeline("cmpl-9", "disagg", history)
    timeline.record_tokens(1, 5_012 * MS)
    timeline.record_tokens(3, 5_030 * MS)
    return timeline


def test_without_opentelemetry_there_is_no_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(otel, "available", lambda: False)
    assert otel.request_span_hook() is None


def test_one_root_span_and_a_child_per_completed_phase() -> None:
    pytest.importorskip("opentelemetry.sdk", reason="the optional `otel` extra is not installed")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    hook = otel.request_span_hook(provider)
    assert hook is not None
    hook(_timeline())
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {
        "pdserve.request", "pdserve.queue", "pdserve.reserve", "pdserve.prefill",
        "pdserve.transfer", "pdserve.handoff", "pdserve.decode",
    }  # fmt: skip
    root = spans["pdserve.request"]
    assert root.parent is None and root.attributes is not None
    assert root.attributes["pdserve.request_id"] == "cmpl-9"
    assert root.attributes["pdserve.num_output_tokens"] == 4
    assert root.start_time == 100 * 10**9 and root.end_time == root.start_time + 40 * MS
    durations_ms = {
        name: (s.end_time - s.start_time) / MS  # type: ignore[operator]
        for name, s in spans.items()
        if name != "pdserve.request"
    }
    assert durations_ms == {
        "pdserve.queue": 2, "pdserve.reserve": 1, "pdserve.prefill": 10, "pdserve.transfer": 4,
        "pdserve.handoff": 5, "pdserve.decode": 23,
    }  # fmt: skip
    for name, span in spans.items():
        if name != "pdserve.request":
            assert span.parent is not None and span.parent.span_id == root.context.span_id
            assert span.context.trace_id == root.context.trace_id
