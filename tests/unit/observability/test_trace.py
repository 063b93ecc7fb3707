"""The waterfall rendering of a timeline."""

from __future__ import annotations

from pdserve.observability.trace import render_waterfall


def _view() -> dict[str, object]:
    ms = 1_000_000
    states = [
        ("RECEIVED", 0, ""),
        ("ROUTED", 1 * ms, "decode=http://d prefill=http://p"),
        ("RESERVED", 2 * ms, "ab12"),
        ("PREFILLING", 2 * ms, "http://p"),
        ("PREFILLED", 12 * ms, "first_token=7"),
        ("TRANSFERRING", 12 * ms, "http://d"),
        ("COMMITTED", 16 * ms, ""),
        ("DECODING", 17 * ms, ""),
        ("FINISHED", 40 * ms, "length"),
    ]
    history = [
        {"state": s, "monotonic_ns": ns, "wall_time_s": 0.0, "detail": d} for s, ns, d in states
    ]
    return {"request_id": "cmpl-1", "mode": "disagg", "state": "FINISHED", "history": history}


def test_waterfall_has_a_row_per_transition_with_offsets_and_durations() -> None:
    text = render_waterfall(_view())
    lines = text.splitlines()
    assert lines[0].startswith("request cmpl-1  mode disagg  state FINISHED  total 40.0 ms")
    rows = lines[2:-1]
    assert [r.split()[0] for r in rows] == [
        "RECEIVED", "ROUTED", "RESERVED", "PREFILLING", "PREFILLED", "TRANSFERRING", "COMMITTED",
        "DECODING", "FINISHED",
    ]  # fmt: skip
    prefilling = rows[3].split()
    assert prefilling[1:3] == ["2.0", "10.0"]  # at 2 ms, for 10 ms
    assert "#" * 10 in rows[3]  # 10 of 40 ms on a 40-column bar
    assert rows[-1].split()[1] == "40.0" and rows[-1].endswith("length")
    assert lines[-1] == "phases: reserve 1.0 ms  prefill 10.0 ms  transfer 4.0 ms  handoff 5.0 ms"


def test_an_empty_history_says_so() -> None:
    view = {"request_id": "x", "mode": "disagg", "state": "RECEIVED", "history": []}
    assert render_waterfall(view) == "request x: no transitions"


def test_worker_events_follow_as_a_second_table_on_the_router_clock() -> None:
    from pdserve.observability.trace import render_merged

    view = _view()
    assert render_merged(view) == ""  # router transitions only: nothing more to show
    ms = 1_000_000
    view["merged"] = [
        {"process": "router", "event": "PREFILLING", "router_ns": 2 * ms, "detail": "http://p"},
        {"process": "prefill-1", "event": "prefill_start", "router_ns": 2 * ms + 250_000,
         "detail": ""},
        {"process": "router", "event": "PREFILLED", "router_ns": 12 * ms, "detail": ""},
    ]  # fmt: skip
    view["clocks"] = [
        {"worker": "http://p", "worker_id": "prefill-1", "offset_ns": -1500, "error_ns": 250_000,
         "num_events": 1, "error": None},
        {"worker": "http://x", "worker_id": None, "offset_ns": None, "error_ns": None,
         "num_events": 0, "error": "refused"},
    ]  # fmt: skip
    lines = render_merged(view).splitlines()
    assert lines[0].split() == ["at", "ms", "process", "event", "detail"]
    assert lines[2].split() == ["2.25", "prefill-1", "prefill_start"]
    assert lines[4] == "clock prefill-1: offset -1.5 us ± 250.0 us, 1 event(s)"
    assert lines[5] == "clock http://x: no answer (refused)"
    assert render_waterfall(view).endswith(lines[-1])
