"""The plot's lanes (pure) and the PNG itself when matplotlib is installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdserve.observability.plot import Span, lanes, save_plot

MS = 1_000_000


def _view() -> dict[str, Any]:
    router = [("RECEIVED", 0), ("PREFILLING", 2), ("PREFILLED", 12), ("FINISHED", 40)]
    events = [
        ("router", "RECEIVED", 0),
        ("router", "PREFILLING", 2),
        ("p", "prefill_start", 3),
        ("p", "prefill_end", 11),
        ("p", "kv_send_start", 11.5),
        ("router", "PREFILLED", 12),
        ("d", "kv_verified", 14),  # no `reserved` in this view: a tick, no span
        ("p", "kv_send_acked", 15),
        ("d", "decode_start", 16),
        ("d", "finished", 39),
        ("router", "FINISHED", 40),
    ]
    return {
        "request_id": "cmpl-1",
        "mode": "disagg",
        "state": "FINISHED",
        "history": [{"state": s, "monotonic_ns": int(t * MS)} for s, t in router],
        "merged": [
            {"process": p, "event": e, "router_ns": int(t * MS), "detail": ""} for p, e, t in events
        ],
    }


def test_lanes_pair_each_process_s_events_into_spans() -> None:
    rows = {lane.process: lane for lane in lanes(_view())}
    assert list(rows) == ["router", "p", "d"]
    assert rows["router"].spans == [
        Span("RECEIVED", 0, 2), Span("PREFILLING", 2, 12), Span("PREFILLED", 12, 40),
    ]  # fmt: skip
    assert rows["p"].spans == [Span("prefill", 3, 11), Span("kv_send", 11.5, 15)]
    assert rows["d"].spans == [Span("decode", 16, 39)]
    assert [name for name, _ in rows["d"].ticks] == ["kv_verified", "decode_start", "finished"]


def test_the_png_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the optional `plot` extra is not installed")
    path = tmp_path / "trace.png"
    save_plot(_view(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
