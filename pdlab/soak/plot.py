"""The PNG of `pdserve chaos --soak ... --plot DIR`: one soak's requests and faults over time.

Top: every request of the soak phase at its end time, its latency on the y axis, coloured by
how the checker judges it (ok, typed error, excused: its router was killed, violation).
Bottom: one lane per fault target with a bar from each fault's start to its end, labelled by
kind. matplotlib comes through `observability.plot.load_pyplot` (the `pdserve[plot]` extra);
the judging is `soak_check`'s, nothing here measures.
"""

from __future__ import annotations

from pathlib import Path

from pdlab.soak.check import check
from pdlab.soak.history import History, Phase
from pdserve.observability.plot import load_pyplot

_COLOURS = {"ok": "tab:green", "typed": "tab:orange", "excused": "tab:grey", "bad": "tab:red"}


def save_soak_plot(history: History, path: Path) -> Path:
    """Draw the soak into `path` (its folder is created)."""
    plt = load_pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    verdict = check(history)
    bad = {x.index for x in verdict.violations if x.phase == Phase.SOAK.value}
    fig, (req_ax, fault_ax) = plt.subplots(
        2, 1, figsize=(12, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    groups: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in _COLOURS}
    for r in history.requests:
        if r.phase is not Phase.SOAK:
            continue
        if r.index in bad:
            kind = "bad"
        elif (r.status is not None and r.status >= 500) or r.ending.value == "stream_error":
            kind = "typed"
        elif r.ending.value in ("cut", "unreachable"):
            kind = "excused"
        else:
            kind = "ok"
        groups[kind][0].append(r.end_s)
        groups[kind][1].append(r.latency_s)
    for kind, (xs, ys) in groups.items():
        if xs:
            req_ax.scatter(xs, ys, s=8, color=_COLOURS[kind], label=f"{kind} ({len(xs)})")
    req_ax.set(ylabel="latency (s)", title="soak: requests by end time, faults below")
    req_ax.legend(loc="upper right", fontsize="small")
    lanes: dict[str, int] = {}
    for f in history.faults:
        if not f.applied or f.start_s is None:
            continue
        lane = lanes.setdefault(" + ".join(f.targets), len(lanes))
        end = f.end_s if f.end_s is not None else f.start_s + 0.5
        fault_ax.barh(lane, max(end - f.start_s, 0.2), left=f.start_s, height=0.6)
        fault_ax.text(f.start_s, lane, f.kind, fontsize=6, va="center")
    fault_ax.set_yticks(list(lanes.values()), list(lanes))
    fault_ax.set(xlabel="seconds into the soak")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
