"""The static-shape decode path that CUDA graphs replay, run eagerly on the CPU: padding rows,
bucketed batch sizes and scratch-block slots give the tokens of the normal path, and padding
writes into no block a request owns."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pdserve.config import EngineConfig, ModelLoadConfig
from pdserve.engine.decode_graphs import DecodeGraphs
from pdserve.engine.engine import Engine
from pdserve.model.loader import LoadedModel, load_model
from pdserve.protocol.sampling import SamplingParams


@pytest.fixture(scope="module")
def model(tiny_model_path: Path) -> LoadedModel:
    return load_model(tiny_model_path)


def run(model: LoadedModel, lengths: list[int], graphs: bool) -> tuple[list[list[int]], Engine]:
    config = EngineConfig(
        model=ModelLoadConfig(path=str(model.path)), num_blocks=128, enable_prefix_caching=False
    )
    eng = Engine(model, config)
    if graphs:
        eng.runner.graphs = DecodeGraphs(
            model.module, eng.kv_cache, max_model_len=512, max_batch=8, capture=False
        )
    rng = random.Random(sum(lengths))
    requests = [
        eng.add_request(
            f"r{i}",
            [rng.randrange(3, 2000) for _ in range(n)],
            SamplingParams(max_tokens=6 + i, temperature=0.0, ignore_eos=True),
        )
        for i, n in enumerate(lengths)
    ]
    while eng.has_unfinished():
        eng.step()
    return [list(r.output_token_ids) for r in requests], eng


@pytest.mark.parametrize("lengths", [[5], [17, 3, 40], [16, 32, 9, 64, 1]])
def test_static_decode_gives_the_tokens_of_the_normal_path(
    model: LoadedModel, lengths: list[int]
) -> None:
    want, _ = run(model, lengths, graphs=False)
    got, eng = run(model, lengths, graphs=True)
    assert got == want
    eng.block_manager.check_invariants()


def test_padding_rows_write_the_scratch_block_only(model: LoadedModel) -> None:
    config = EngineConfig(model=ModelLoadConfig(path=str(model.path)), num_blocks=16)
    eng = Engine(model, config)
    graphs = DecodeGraphs(model.module, eng.kv_cache, 64, max_batch=4, capture=False)
    before = eng.kv_cache.tensor[: eng.kv_cache.num_blocks].clone()
    hidden = graphs.run([5, 6, 7], [0, 0, 0], [[1], [2], [3]])  # 3 rows in the 4-row shape
    assert hidden.shape[0] == 3 and torch.isfinite(hidden).all()
    after = eng.kv_cache.tensor[: eng.kv_cache.num_blocks]
    changed = {b for b in range(eng.kv_cache.num_blocks) if not torch.equal(before[b], after[b])}
    assert changed == {1, 2, 3}


def test_fits_bounds_batch_and_context(model: LoadedModel) -> None:
    eng = Engine(model, EngineConfig(model=ModelLoadConfig(path=str(model.path)), num_blocks=16))
    graphs = DecodeGraphs(model.module, eng.kv_cache, 64, max_batch=8, capture=False)
    assert graphs.sizes == [1, 2, 4, 8]
    assert graphs.fits(8, 64) and not graphs.fits(9, 10) and not graphs.fits(1, 65)
