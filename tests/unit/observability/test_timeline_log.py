"""Timeline events: the bounded ring, suffixed worker ids, JSON log lines, merging clocks."""

from __future__ import annotations

import json
import logging

import pytest

from pdserve.observability.timeline_log import LOGGER_NAME, EventRing, TimelineEvent
from pdserve.observability.timeline_merge import ProcessEvents, call_bounds, merge_events
from pdserve.protocol.request_state import RequestState, Transition


def test_the_ring_keeps_the_last_requests_whole() -> None:
    ring = EventRing("w", max_requests=2)
    for rid in ("a", "b", "a", "c"):
        ring.record(rid, "x")
    assert len(ring) == 2
    assert ring.events_for("a") == []  # evicted with both of its events
    assert [e.request_id for e in ring.events_for("c")] == ["c"]
    with pytest.raises(ValueError, match="max_requests"):
        EventRing("w", 0)


def test_events_of_retried_and_migrated_ids_belong_to_the_request() -> None:
    ring = EventRing("w")
    for rid in ("cmpl-1", "cmpl-1.r1", "cmpl-1.m2", "cmpl-10", "cmpl-2"):
        ring.record(rid, "x")
    assert [e.request_id for e in ring.events_for("cmpl-1")] == ["cmpl-1", "cmpl-1.r1", "cmpl-1.m2"]


def test_each_event_is_one_json_log_line(caplog: pytest.LogCaptureFixture) -> None:
    ring = EventRing("prefill-7")
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        event = ring.record("cmpl-1", "prefill_start", 'detail "quoted"')
    [record] = [r for r in caplog.records if r.name == LOGGER_NAME]
    assert json.loads(record.getMessage()) == {
        "request_id": "cmpl-1",
        "process": "prefill-7",
        "event": "prefill_start",
        "monotonic_ns": event.monotonic_ns,
        "wall_time_s": event.wall_time_s,
        "detail": 'detail "quoted"',
    }


def _ev(process: str, event: str, ns: int) -> TimelineEvent:
    return TimelineEvent("r", process, event, ns, 0.0)


def test_merging_moves_each_worker_to_the_router_clock() -> None:
    # The prefill worker's clock is 1 s ahead of the router's, the decode worker's 2 s behind:
    # sorted by raw clocks the order would be decode, router, prefill.
    router = [_ev("router", "PREFILLING", 100), _ev("router", "PREFILLED", 400)]
    prefill = ProcessEvents(
        [_ev("p", "prefill_end", 1_000_000_300), _ev("p", "prefill_start", 1_000_000_200)],
        offset_ns=1_000_000_000,
    )
    decode = ProcessEvents([_ev("d", "kv_verified", -2_000_000_000 + 450)], -2_000_000_000)
    merged = merge_events(router, [prefill, decode])
    assert [(e.process, e.event, e.router_ns) for e in merged] == [
        ("router", "PREFILLING", 100),
        ("p", "prefill_start", 200),
        ("p", "prefill_end", 300),
        ("router", "PREFILLED", 400),
        ("d", "kv_verified", 450),
    ]
    assert merged[1].monotonic_ns == 1_000_000_200  # the worker's own stamp is kept


def _tr(state: str, ns: int, detail: str = "") -> Transition:
    return Transition(RequestState[state], ns, 0.0, detail)


def _wev(rid: str, event: str, ns: int) -> TimelineEvent:
    return TimelineEvent(rid, "w", event, ns, 0.0)


def test_a_request_s_own_calls_bound_the_worker_offset() -> None:
    off = 1_000_000  # worker clock = router clock + 1 ms
    history = [
        _tr("RECEIVED", 0),
        _tr("ROUTED", 10, "decode=http://d prefill=http://p"),
        _tr("RESERVED", 50),
        _tr("PREFILLING", 60, "http://p"),
        _tr("PREFILLED", 500),
        _tr("TRANSFERRING", 510, "http://d"),
        _tr("COMMITTED", 900),
        _tr("DECODING", 910),
        _tr("FINISHED", 2_000, "length"),
    ]
    prefill = [_wev("r", "prefill_start", 80 + off), _wev("r", "prefill_end", 470 + off)]
    # Prefill call: start 20 after PREFILLING, end 30 before PREFILLED.
    assert call_bounds("r", history, "http://p", prefill) == (off - 30, off + 20)
    decode = [
        _wev("r", "reserved", 30 + off),
        _wev("r", "decode_start", 880 + off),
        _wev("r", "first_token", 890 + off),
        _wev("r", "finished", 1_990 + off),
    ]
    # reserved: 20 after ROUTED, 20 before RESERVED; decode_start: 20 before COMMITTED;
    # first_token 20 before DECODING; finished 10 before FINISHED.
    assert call_bounds("r", history, "http://d", decode) == (off - 10, off + 20)
    # A worker the calls did not go to, and another request's ids, prove nothing.
    assert call_bounds("r", history, "http://x", decode) == (None, None)
    assert call_bounds("q", history, "http://p", prefill) == (None, None)


def test_after_a_retry_only_the_first_attempt_bounds_the_offset() -> None:
    history = [
        _tr("RECEIVED", 0),
        _tr("ROUTED", 10, "decode=http://d prefill=http://p"),
        _tr("RETRYING", 20, "refused"),  # the reservation answer bound is not used
        _tr("ROUTED", 30, "decode=http://d prefill=http://p"),
        _tr("RESERVED", 40),
        _tr("PREFILLING", 50, "http://p"),
        _tr("RETRYING", 90, "prefill failed: timeout"),  # the prefill may still be running
        _tr("FAILED", 95, "gave up"),
    ]
    events = [
        _wev("r", "reserved", 35),
        _wev("r", "prefill_start", 60),
        _wev("r", "prefill_end", 120),
        _wev("r.r1", "prefill_start", 1),
    ]
    assert call_bounds("r", history, "http://d", events) == (None, 25)
    assert call_bounds("r", history, "http://p", events) == (None, 10)


def test_a_colocated_generate_call_bounds_the_offset() -> None:
    history = [
        _tr("RECEIVED", 0),
        _tr("ROUTED", 10, "http://w"),
        _tr("DECODING", 300),
        _tr("FINISHED", 900, "stop"),
    ]
    events = [
        _wev("r", "generate_start", 40),
        _wev("r", "first_token", 250),
        _wev("r", "finished", 880),
    ]
    assert call_bounds("r", history, "http://w", events) == (-20, 30)
    # Finished by the router (a stop string): the worker's `finished` may come later.
    history[-1] = _tr("FINISHED", 900, "router: stop")
    assert call_bounds("r", history, "http://w", events) == (-50, 30)
