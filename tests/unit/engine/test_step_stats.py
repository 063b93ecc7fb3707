"""Step facts: how a step is classified, how busy time is attributed, and what the engine's
deltas carry (a long prompt admitted while another request decodes makes a mixed step)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdserve.config import EngineConfig, ModelLoadConfig
from pdserve.engine.engine import Engine
from pdserve.engine.step_stats import (
    StepFacts,
    StepKind,
    StepTotals,
    count_tokens,
    is_decode_slice,
)
from pdserve.model.loader import LoadedModel, load_model
from pdserve.protocol.sampling import SamplingParams


def test_a_slice_is_decode_only_when_it_is_one_token_after_an_output_token() -> None:
    assert is_decode_slice(1, 1)
    assert not is_decode_slice(1, 0)  # a one-token prompt: its prefill
    assert not is_decode_slice(7, 3)  # a resumed request recomputing its tokens
    assert count_tokens([(1, 4), (1, 9), (300, 0), (1, 0)]) == (301, 2)


def test_step_kind_says_what_shared_the_batch() -> None:
    assert StepFacts(0, 0.1, 0, 3).kind is StepKind.DECODE
    assert StepFacts(0, 0.1, 512, 0).kind is StepKind.PREFILL
    mixed = StepFacts(0, 0.1, 512, 3)
    assert mixed.kind is StepKind.MIXED and mixed.with_prefill


def test_busy_time_of_a_mixed_step_gives_decode_what_a_decode_step_costs() -> None:
    totals = StepTotals()
    # Before any decode-only step: split by tokens.
    totals.observe(StepFacts(0, 0.100, 90, 10))
    assert totals.decode_busy_s == pytest.approx(0.010)
    assert totals.prefill_busy_s == pytest.approx(0.090)
    totals.observe(StepFacts(1, 0.004, 0, 10))
    totals.observe(StepFacts(2, 0.009, 0, 10))
    # Baseline: 0.004, then 0.8 * 0.004 + 0.2 * 0.009.
    assert totals.decode_step_baseline_s == pytest.approx(0.005)
    totals.observe(StepFacts(3, 0.200, 1000, 10))
    assert totals.decode_busy_s == pytest.approx(0.010 + 0.004 + 0.009 + 0.005)
    assert totals.prefill_busy_s == pytest.approx(0.090 + 0.195)
    # A mixed step shorter than the baseline is all decode.
    totals.observe(StepFacts(4, 0.003, 2, 10))
    assert totals.prefill_busy_s == pytest.approx(0.285)
    totals.observe(StepFacts(5, 0.050, 64, 0))
    assert (totals.num_steps, totals.num_decode_steps, totals.num_prefill_steps) == (6, 2, 1)
    assert (totals.num_mixed_steps, totals.num_prefill_tokens, totals.num_decode_tokens) == (
        3,
        1156,
        50,
    )
    assert totals.busy_s == pytest.approx(totals.prefill_busy_s + totals.decode_busy_s)


@pytest.fixture(scope="module")
def model(tiny_model_path: Path) -> LoadedModel:
    return load_model(str(tiny_model_path))


def test_a_prompt_admitted_while_another_decodes_makes_a_mixed_step(model: LoadedModel) -> None:
    engine = Engine(model, EngineConfig(model=ModelLoadConfig(path=str(model.path))))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [rng.randrange(3, 2000) for _ in range(20)], params)
    first = engine.step()
    assert [(d.request_id, d.decode) for d in first] == [("a", False)]
    assert first[0].step is not None and first[0].step.kind is StepKind.PREFILL
    assert first[0].step.num_prefill_tokens == 20
    engine.add_request("b", [rng.randrange(3, 2000) for _ in range(100)], params)
    mixed = engine.step()
    assert [(d.request_id, d.decode) for d in mixed] == [("a", True), ("b", False)]
    step = mixed[0].step
    assert step is not None and step is mixed[1].step
    assert (step.index, step.num_prefill_tokens, step.num_decode_tokens) == (1, 100, 1)
    assert step.kind is StepKind.MIXED and step.duration_s > 0
    decode = engine.step()
    assert all(d.decode for d in decode) and decode[0].step is not None
    assert decode[0].step.kind is StepKind.DECODE
    totals = engine.stats().steps
    assert (totals.num_prefill_steps, totals.num_mixed_steps, totals.num_decode_steps) == (1, 1, 1)
    assert totals.num_prefill_tokens == 120 and totals.num_decode_tokens == 3
