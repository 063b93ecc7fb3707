"""The decode-step breakdown of `pdserve bench engine`: parts that add up to the step, timers
that leave nothing patched, requests that leave nothing held; and the model shapes' names."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdlab.bench import model_shapes, step_breakdown
from pdlab.bench.step_breakdown import PARTS, measure_decode_breakdown
from pdserve.config import EngineConfig, ModelLoadConfig
from pdserve.engine import model_runner
from pdserve.engine.engine import Engine
from pdserve.errors import ConfigError
from pdserve.model import attention, llama


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Engine:
    return Engine.from_config(
        EngineConfig(
            block_size=16,
            kv_cache_bytes=64 << 20,
            enable_prefix_caching=False,
            model=ModelLoadConfig(path=str(tiny_model_path)),
        )
    )


def _timed_functions() -> tuple[object, ...]:
    """The functions the breakdown wraps, as their owners hold them now."""
    return (
        llama.LlamaModel.forward,
        llama.LlamaModel.compute_logits,
        llama.paged_attention,
        attention._gather,
        model_runner.sample_row,
        model_runner.token_logprobs,
    )


# (12, 300): the prompts take several chunked steps; the first done decode meanwhile.
@pytest.mark.parametrize(("batch", "prompt_len"), [(1, 40), (5, 40), (12, 300)])
def test_the_parts_add_up_to_the_step_and_nothing_stays_patched_or_held(
    engine: Engine, batch: int, prompt_len: int
) -> None:
    originals = _timed_functions()
    free = engine.block_manager.num_free_blocks
    rng = random.Random(batch)
    prompts = [[rng.randrange(3, 2000) for _ in range(prompt_len)] for _ in range(batch)]
    parts = measure_decode_breakdown(engine, prompts, num_steps=3)
    assert set(parts) == {*PARTS, "step"}
    for name in ("model", "attention", "gathers", "logits", "sampler"):
        assert parts[name] > 0, name
    assert sum(parts[p] for p in PARTS) == pytest.approx(parts["step"])
    assert _timed_functions() == originals
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == free


def test_a_timer_is_removed_even_when_the_step_raises(engine: Engine) -> None:
    timers = step_breakdown._Timers()
    forward = llama.LlamaModel.forward
    with pytest.raises(RuntimeError), step_breakdown._patched(timers):
        assert llama.LlamaModel.forward is not forward
        raise RuntimeError("step failed")
    assert llama.LlamaModel.forward is forward


def test_shapes_are_named_and_an_unknown_name_is_refused(tmp_path: Path) -> None:
    c = model_shapes.SHAPES["smollm-135m"]
    # SmolLM-135M's published size follows from the dimensions (tied embeddings).
    h, kv = c["hidden_size"], c["num_key_value_heads"] * c["head_dim"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * c["intermediate_size"] + 2 * h
    total = c["vocab_size"] * h + c["num_hidden_layers"] * per_layer + h
    assert 134e6 < total < 135e6
    with pytest.raises(ConfigError, match="--model-shape: 'gpt-5'"):
        model_shapes.build_shape_checkpoint("gpt-5", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_the_cli_offers_exactly_the_shapes_that_exist() -> None:
    from pdlab.bench.command import MODEL_SHAPES

    assert set(MODEL_SHAPES) == {"tiny", *model_shapes.SHAPES}
