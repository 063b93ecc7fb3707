"""`pdserve trace REQUEST_ID --plot FILE`: one request's merged timeline as a PNG waterfall.

One lane per process (router first, then workers in order of their first event). A lane holds
spans: on the router each state from its transition to the next; on a worker the intervals
between paired events (`prefill_start`→`prefill_end`, `kv_send_start`→`kv_send_acked` or
`kv_send_failed`, `reserved`→`kv_verified`, `decode_start`/`generate_start`→`finished`), and
a tick for every event. Times are milliseconds from RECEIVED on the router's clock.

`lanes` is pure and tested without matplotlib; `save_plot` (and `load_pyplot`, which the
benchmarks' plots share) imports matplotlib only when called (the optional extra
`pdserve[plot]`) and raises `PlotUnavailable` when it is absent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.errors import PdserveError

# Worker spans: an event that opens one, and the events that may close it.
WORKER_SPANS: dict[str, tuple[str, ...]] = {
    "prefill_start": ("prefill_end",),
    "kv_send_start": ("kv_send_acked", "kv_send_failed"),
    "reserved": ("kv_verified", "reservation_cancelled"),
    "decode_start": ("finished", "aborted"),
    "generate_start": ("finished", "aborted"),
}


class PlotUnavailable(PdserveError):
    """matplotlib is not installed (pip install 'pdserve[plot]')."""


@dataclass(frozen=True, slots=True)
class Span:
    """A labelled interval on a lane, in ms from RECEIVED."""

    label: str
    start_ms: float
    end_ms: float


@dataclass(slots=True)
class Lane:
    """One process's row."""

    process: str
    spans: list[Span] = field(default_factory=list)
    ticks: list[tuple[str, float]] = field(default_factory=list)


def lanes(view: Mapping[str, Any]) -> list[Lane]:
    """The rows of the plot from a /debug/requests view (its `merged` events)."""
    merged: Sequence[Mapping[str, Any]] = view.get("merged") or [
        {"process": "router", "event": t["state"], "router_ns": t["monotonic_ns"]}
        for t in view["history"]
    ]
    start = int(view["history"][0]["monotonic_ns"])
    rows: dict[str, Lane] = {"router": Lane("router")}
    for e in merged:
        rows.setdefault(str(e["process"]), Lane(str(e["process"])))
    router = [e for e in merged if e["process"] == "router"]
    for i, e in enumerate(router):
        at = (int(e["router_ns"]) - start) / 1e6
        rows["router"].ticks.append((str(e["event"]), at))
        if i + 1 < len(router):
            end = (int(router[i + 1]["router_ns"]) - start) / 1e6
            rows["router"].spans.append(Span(str(e["event"]), at, end))
    for process, lane in rows.items():
        if process == "router":
            continue
        events = [e for e in merged if e["process"] == process]
        opened: dict[str, float] = {}
        for e in events:
            name, at = str(e["event"]), (int(e["router_ns"]) - start) / 1e6
            lane.ticks.append((name, at))
            for opener, closers in WORKER_SPANS.items():
                if name in closers and opener in opened:
                    lane.spans.append(Span(opener.rsplit("_", 1)[0], opened.pop(opener), at))
            if name in WORKER_SPANS:
                opened[name] = at
    return list(rows.values())


def load_pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend; `PlotUnavailable` when it is absent.

    Every plotting command calls this first, so a missing extra fails before any work is done.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("plotting needs matplotlib: pip install 'pdserve[plot]'") from None
    return plt


def save_plot(view: Mapping[str, Any], path: Path) -> None:
    """Draw the waterfall of `view` into `path` (PNG, or any format matplotlib infers)."""
    plt = load_pyplot()
    rows = lanes(view)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.9 * len(rows)))
    cmap = plt.get_cmap("tab20")
    colors = [cmap(i) for i in range(20)]
    palette: dict[str, Any] = {}
    total_ms = max((s.end_ms for lane in rows for s in lane.spans), default=1.0) or 1.0
    for y, lane in enumerate(reversed(rows)):
        for span in lane.spans:
            new = span.label not in palette
            color = palette.setdefault(span.label, colors[len(palette) % len(colors)])
            width = max(span.end_ms - span.start_ms, 1e-3)
            ax.barh(
                y, width, left=span.start_ms, height=0.6, color=color, edgecolor="black",
                label=span.label if new else None,
            )  # fmt: skip
            if width >= 0.04 * total_ms:  # short spans are named by the legend only
                ax.text(span.start_ms, y + 0.35, span.label, fontsize=7, va="bottom")
        for _, at in lane.ticks:
            ax.plot([at, at], [y - 0.35, y + 0.35], color="black", linewidth=0.6)
    ax.set_yticks(range(len(rows)), [lane.process for lane in reversed(rows)])
    ax.set_xlabel("ms since RECEIVED (router clock)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_title(f"request {view.get('request_id')} ({view.get('mode')}, {view.get('state')})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
