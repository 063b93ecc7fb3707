"""The engine's half of decode checkpoints: a decoding request's blocks copied out of one
engine and imported into another resume it there with only the tail recomputed, and the same
tokens as an uninterrupted run; an import that is not committed leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.config import EngineConfig, ModelLoadConfig
from pdserve.engine.engine import Engine
from pdserve.errors import RequestNotFound
from pdserve.model.loader import LoadedModel, load_model
from pdserve.protocol.sampling import SamplingParams

BS = 16


@pytest.fixture(scope="module")
def model(tiny_model_path: Path) -> LoadedModel:
    return load_model(str(tiny_model_path))


def engine(model: LoadedModel, staged: bool = False) -> Engine:
    config = EngineConfig(
        model=ModelLoadConfig(path=str(model.path)), num_blocks=64, kv_host_staging=staged
    )
    return Engine(model, config)


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 5}])
def test_imported_blocks_resume_with_only_the_tail_recomputed(
    model: LoadedModel, sampling: dict[str, object], staged: bool
) -> None:
    """`staged`: both engines keep their KV apart from the transfer views (as on a GPU): the
    checkpoint's copies are staged out, the import's blocks staged in when committed."""
    prompt = [(7 * i) % 1900 + 3 for i in range(40)]
    params = SamplingParams(max_tokens=60, ignore_eos=True, **sampling)  # type: ignore[arg-type]
    reference = engine(model)
    full = reference.add_request("ref", prompt, params)
    while reference.has_unfinished():
        reference.step()
    # The decoding worker, stopped after 30 tokens: copy its full blocks (the checkpoint).
    source = engine(model, staged)
    request = source.add_request("r", prompt, params)
    while len(request.output_token_ids) < 30:
        source.step()
    sent = list(request.output_token_ids[:30])
    tokens = [*prompt, *sent]
    num_blocks = (len(tokens) - 1) // BS  # 4: 64 of the 70 tokens
    copies = source.copy_blocks("r", 0, num_blocks)
    # The resuming worker: import them, commit them to its prefix cache, resume.
    target = engine(model, staged)
    views = target.import_begin("r#checkpoint", num_blocks)
    assert views is not None and len(views) == num_blocks
    for view, data in zip(views, copies, strict=True):
        view[:] = data
    target.import_end("r#checkpoint", tokens[: num_blocks * BS])
    assert target.staging.num_pending == 0
    assert target.num_cached_prefix_blocks(tokens) == num_blocks
    resumed = target.add_request("r.m1", prompt, params, output_token_ids=sent)
    while target.has_unfinished():
        target.step()
    assert resumed.num_cached_tokens == num_blocks * BS  # 6 tokens recomputed
    assert list(resumed.output_token_ids) == list(full.output_token_ids)
    target.block_manager.check_invariants()
    assert target.stats().num_held_blocks == 0


def test_an_uncommitted_import_frees_its_blocks_unregistered(model: LoadedModel) -> None:
    target = engine(model)
    free = target.block_manager.num_free_blocks
    views = target.import_begin("x#checkpoint", 3)
    assert views is not None and target.block_manager.num_free_blocks == free - 3
    target.import_end("x#checkpoint", None)  # verification failed: nothing registered
    assert target.block_manager.num_free_blocks == free
    assert target.block_manager.num_cached_blocks == 0
    assert target.import_begin("y#checkpoint", 65) is None  # no room: nothing taken
    assert target.block_manager.num_free_blocks == free
    with pytest.raises(RequestNotFound):
        target.copy_blocks("missing", 0, 1)
