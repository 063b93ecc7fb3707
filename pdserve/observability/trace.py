"""`pdserve trace REQUEST_ID`: one request's timeline as a text waterfall.

Reads the router's `GET /debug/requests/{id}` and prints one row per transition: the state,
its offset from RECEIVED, how long the request stayed there, a bar on a common scale, and the
detail (worker chosen, retry reason, error). When the router merged the workers' events into
the view (`merged`), they follow as a second table: every process's events on the router's
clock, with each worker's clock offset and its error bound. Rendering is pure
(`render_waterfall`, `render_merged`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.error import HTTPError, URLError
from urllib.request import urlopen

from pdserve.errors import PdserveError
from pdserve.observability.phases import handoff_phases
from pdserve.protocol.request_state import RequestState, Transition

BAR_WIDTH = 40


class TraceError(PdserveError):
    """The router does not know the request, or did not answer."""


def fetch_timeline(
    router_url: str, request_id: str, timeout_s: float = 3.0, workers: bool = False
) -> dict[str, Any]:
    """The router's timeline JSON for `request_id`; with `workers`, merged with the workers'
    events (the router asks each of them)."""
    url = f"{router_url.rstrip('/')}/debug/requests/{request_id}"
    url += "" if workers else "?workers=0"
    try:
        with urlopen(url, timeout=timeout_s) as resp:
            data = json.loads(resp.read())
    except HTTPError as exc:
        if exc.code == 404:
            msg = f"router {router_url}: unknown or evicted request {request_id}"
            raise TraceError(msg) from None
        raise TraceError(f"router {router_url}: HTTP {exc.code} for {url}") from None
    except (URLError, OSError, ValueError) as exc:
        raise TraceError(f"router {router_url} did not answer {url}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("history"), list):
        raise TraceError(f"router {router_url}: {url} is not a timeline")
    return data


def render_waterfall(view: Mapping[str, Any]) -> str:
    """The timeline (the /debug/requests JSON) as a waterfall table with phase totals."""
    history: Sequence[Mapping[str, Any]] = view["history"]
    if not history:
        return f"request {view.get('request_id')}: no transitions"
    start = int(history[0]["monotonic_ns"])
    end = int(history[-1]["monotonic_ns"])
    total = max(end - start, 1)
    lines = [
        f"request {view['request_id']}  mode {view['mode']}  state {view['state']}"
        f"  total {(end - start) / 1e6:.1f} ms",
        f"{'state':<13} {'at ms':>9} {'for ms':>9}  {'':<{BAR_WIDTH}}  detail",
    ]
    for i, t in enumerate(history):
        at = int(t["monotonic_ns"]) - start
        nxt = int(history[i + 1]["monotonic_ns"]) if i + 1 < len(history) else None
        dur = None if nxt is None else nxt - int(t["monotonic_ns"])
        left = round(at / total * BAR_WIDTH)
        width = 0 if dur is None else max(1, round(dur / total * BAR_WIDTH))
        bar = (" " * left + "#" * width)[:BAR_WIDTH]
        dur_text = "" if dur is None else f"{dur / 1e6:.1f}"
        lines.append(
            f"{t['state']:<13} {at / 1e6:>9.1f} {dur_text:>9}  {bar:<{BAR_WIDTH}}  {t['detail']}"
        )
    transitions = [
        Transition(RequestState[str(t["state"])], int(t["monotonic_ns"]), 0.0) for t in history
    ]
    phases = handoff_phases(transitions)
    if phases:
        lines.append(
            "phases: " + "  ".join(f"{name} {sec * 1e3:.1f} ms" for name, sec in phases.items())
        )
    merged = render_merged(view)
    return "\n".join(lines) + ("\n\n" + merged if merged else "")


def render_merged(view: Mapping[str, Any]) -> str:
    """The events of every process on the router's clock ("" when the view has no worker
    events): offset from RECEIVED, process, event, detail; then each worker's clock."""
    merged: Sequence[Mapping[str, Any]] = view.get("merged") or []
    if not any(e["process"] != "router" for e in merged):
        return ""
    start = int(view["history"][0]["monotonic_ns"])
    width = max(len(str(e["process"])) for e in merged)
    lines = [f"{'at ms':>9}  {'process':<{width}}  {'event':<22}  detail"]
    for e in merged:
        at = (int(e["router_ns"]) - start) / 1e6
        lines.append(f"{at:>9.2f}  {e['process']:<{width}}  {e['event']:<22}  {e['detail']}")
    for c in view.get("clocks") or []:
        if c.get("error"):
            lines.append(f"clock {c['worker']}: no answer ({c['error']})")
        else:
            lines.append(
                f"clock {c['worker_id']}: offset {c['offset_ns'] / 1e3:+.1f} us"
                f" ± {c['error_ns'] / 1e3:.1f} us, {c['num_events']} event(s)"
            )
    return "\n".join(lines)
