"""Engine step facts as the worker reports them: on each streamed token, in /health, in /metrics.

- Every `TokenEvent` made by a step carries that step's `StepInfo` (index, seconds, prefill
  and decode tokens, whether this request's slice was a decode slice), so the router sees, per
  decode token, whether it waited for a prefill chunk in the same batch;
- `/health` carries the cumulative `StepTotalsModel`, which the router's auto mode
  differences between polls (per-phase busy time, so it covers prefill-only work too, which
  streams nothing);
- `/metrics` renders steps and seconds per kind (`decode`, `prefill`, `mixed`), so
  rate(seconds) / rate(steps) is the mean step time of each kind.

It converts and formats; the figures are the engine's (`pdserve.engine.step_stats`).
"""

from __future__ import annotations

import dataclasses

from pdserve.engine.outputs import RequestDelta
from pdserve.engine.step_stats import StepKind, StepTotals
from pdserve.observability import metric_names as m
from pdserve.observability.exposition import render_family, render_text
from pdserve.protocol.worker_api import StepInfo, StepTotalsModel


def step_info(delta: RequestDelta) -> StepInfo | None:
    """The wire form of the step that produced `delta` (None when no step did)."""
    step = delta.step
    if step is None:
        return None
    return StepInfo(
        index=step.index,
        duration_s=step.duration_s,
        num_prefill_tokens=step.num_prefill_tokens,
        num_decode_tokens=step.num_decode_tokens,
        decode=delta.decode,
    )


def step_totals_model(totals: StepTotals) -> StepTotalsModel:
    """The wire form of the engine's cumulative step figures."""
    fields = dataclasses.asdict(totals)
    fields.pop("decode_step_baseline_s")  # an internal estimate, not a total
    return StepTotalsModel(**fields)


def render_steps(worker_id: str, totals: StepTotals) -> str:
    """Prometheus lines: steps and step seconds per kind, attributed busy seconds per phase."""
    w = {"worker_id": worker_id}
    per_kind = (
        (StepKind.DECODE, totals.num_decode_steps, totals.decode_steps_s),
        (StepKind.PREFILL, totals.num_prefill_steps, totals.prefill_steps_s),
        (StepKind.MIXED, totals.num_mixed_steps, totals.mixed_steps_s),
    )
    lines = render_family(m.WORKER_STEPS, (({**w, "batch": k.value}, n) for k, n, _ in per_kind))
    lines += render_family(
        m.WORKER_STEP_SECONDS, (({**w, "batch": k.value}, s) for k, _, s in per_kind)
    )
    lines += render_family(
        m.WORKER_PHASE_BUSY_SECONDS,
        [
            ({**w, "phase": "prefill"}, totals.prefill_busy_s),
            ({**w, "phase": "decode"}, totals.decode_busy_s),
        ],
    )
    return render_text(lines)
