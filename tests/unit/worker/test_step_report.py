"""The worker's step report: a delta's step on the wire, cumulative totals, and /metrics lines."""

from __future__ import annotations

from pdserve.engine.outputs import RequestDelta
from pdserve.engine.step_stats import StepFacts, StepTotals
from pdserve.observability.exposition import parse, total
from pdserve.worker.step_report import render_steps, step_info, step_totals_model


def test_a_delta_s_step_goes_on_the_wire_with_its_decode_flag() -> None:
    facts = StepFacts(7, 0.25, 900, 3)
    info = step_info(RequestDelta("r", (5,), False, None, step=facts, decode=True))
    assert info is not None
    assert (info.index, info.duration_s, info.num_prefill_tokens, info.decode) == (
        7,
        0.25,
        900,
        True,
    )
    assert step_info(RequestDelta("r", (), True, "abort")) is None


def test_totals_and_metrics() -> None:
    totals = StepTotals()
    for facts in (StepFacts(0, 0.1, 100, 0), StepFacts(1, 0.01, 0, 2), StepFacts(2, 0.2, 50, 2)):
        totals.observe(facts)
    model = step_totals_model(totals)
    assert (model.num_steps, model.num_mixed_steps, model.num_decode_tokens) == (3, 1, 4)
    samples = parse(render_steps("w1", totals))
    assert total(samples, "pdserve_worker_steps_total", batch="mixed") == 1
    assert total(samples, "pdserve_worker_step_seconds_total", batch="prefill") == 0.1
    busy = total(samples, "pdserve_worker_phase_busy_seconds_total")
    assert abs(busy - 0.31) < 1e-9
    assert total(samples, "pdserve_worker_phase_busy_seconds_total", phase="decode") == 0.02
