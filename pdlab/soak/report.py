"""What a soak shows a person: the report on a terminal, the JSON verdict, the stored history.

`render_report` and `verdict_json` turn a `SoakResult` (history + the checker's verdict) into
text and JSON-ready data; `write_history` stores the history as JSON lines; `check_history`
(`pdserve chaos --check FILE`) reads one back and judges it again with the same checker.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from pdlab.soak.check import Verdict, check
from pdlab.soak.history import History, from_lines, to_lines


@dataclass(slots=True)
class SoakResult:
    """A finished soak: the history and the checker's verdict."""

    history: History
    verdict: Verdict
    wall_s: float = 0.0


def write_history(history: History, path: Path) -> None:
    """The history as JSON lines at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for line in to_lines(history):
            out.write(line + "\n")


def render_report(result: SoakResult) -> str:
    """The soak's figures, violations and missed targets, for a terminal."""
    v, meta = result.verdict, result.history.meta
    s, free = v.soak, v.fault_free
    lines = [
        f"soak {meta.duration_s:.0f} s at {meta.rate:g} req/s, seed {meta.seed},"
        f" nemesis {','.join(meta.nemesis)}; wall {result.wall_s:.0f} s",
        f"faults: {v.num_faults_applied} applied, {v.num_faults_skipped} skipped"
        + (f" (partition not run: {meta.netns_unavailable})" if meta.netns_unavailable else ""),
        f"requests: {s.num_sent} sent, {s.num_ok} as expected, {s.num_typed_errors} typed errors,"
        f" {s.num_excused} with their router killed",
        f"availability {s.availability:.4f}; excluding router kills {s.availability_excused:.4f}",
        f"divergent {s.num_divergent}, tokens lost {s.num_tokens_lost}, duplicated"
        f" {s.num_tokens_duplicated}, past deadline {s.num_past_deadline}, leaked blocks"
        f" {v.num_leaked_blocks}, processes left {len(result.history.quiescence.processes_left)}",
        f"goodput {v.goodput_req_s:.3f} req/s ({v.goodput_tokens_s:.1f} tok/s) under faults vs"
        f" {v.fault_free_goodput_req_s:.3f} req/s ({v.fault_free_goodput_tokens_s:.1f} tok/s)"
        f" fault-free ({free.num_ok}/{free.num_sent} ok): ratio {v.goodput_ratio:.3f}",
    ]
    if s.errors:
        lines.append("typed errors: " + ", ".join(f"{k} x{n}" for k, n in sorted(s.errors.items())))
    lines.append(f"{'fault':<14} {'count':>5} {'recovered':>9} {'p50 s':>7} {'max s':>7}")
    for r in v.recovery:
        lines.append(
            f"{r.kind:<14} {r.num_faults:>5} {r.num_recovered:>9} {r.p50_s:>7.2f} {r.max_s:>7.2f}"
        )
    for x in v.violations[:20]:
        lines.append(f"violation [{x.phase} #{x.index}] {x.rule}: {x.detail}")
    if len(v.violations) > 20:
        lines.append(f"... {len(v.violations) - 20} more violations in the JSON report")
    lines.append("PASS" if v.passed else "FAIL: " + "; ".join(v.missed))
    return "\n".join(lines)


def verdict_json(result: SoakResult) -> dict[str, object]:
    """The verdict and its figures as JSON-ready data."""
    v = result.verdict
    data = dataclasses.asdict(v)
    data.update(
        passed=v.passed,
        goodput_ratio=v.goodput_ratio,
        availability=v.soak.availability,
        availability_excluding_router_kills=v.soak.availability_excused,
        meta=dataclasses.asdict(result.history.meta),
        faults=[dataclasses.asdict(f) for f in result.history.faults],
        wall_s=result.wall_s,
    )
    return data


def check_history(path: Path, json_path: Path | None = None) -> int:
    """`pdserve chaos --check HISTORY`: judge a stored history again (0: passed)."""
    history = from_lines(path.read_text().splitlines())
    result = SoakResult(history, check(history))
    if json_path is not None:
        json_path.write_text(json.dumps(verdict_json(result), indent=2, default=str))
    print(render_report(result))
    return 0 if result.verdict.passed else 1
