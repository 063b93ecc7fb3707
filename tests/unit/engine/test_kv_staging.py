"""A staged KV cache (a GPU engine's host mirror, exercised here on the CPU with
`kv_host_staging`): handoffs through the mirror decode like colocated, blocks this engine
already holds are never staged in over, and nothing the model reads depends on the mirror."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pdserve.config import EngineConfig, ModelLoadConfig
from pdserve.engine.engine import Engine
from pdserve.model.loader import LoadedModel, load_model
from pdserve.protocol.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_path: Path) -> LoadedModel:
    return load_model(tiny_model_path)


def engine(model: LoadedModel, staged: bool, **kw: object) -> Engine:
    config = EngineConfig(
        model=ModelLoadConfig(path=str(model.path)), num_blocks=64, kv_host_staging=staged, **kw
    )  # type: ignore[arg-type]
    return Engine(model, config)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def finish(eng: Engine) -> None:
    while eng.has_unfinished():
        eng.step()


def handoff(prefill: Engine, decode: Engine, rid: str, tokens: list[int]) -> list[int]:
    """Prefill on one engine, copy its held KV through the views, decode on the other."""
    pre = prefill.add_request(
        rid, tokens, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True
    )
    finish(prefill)
    skip_tokens = decode.add_remote_request(rid, tokens, GREEDY)
    skip = skip_tokens // decode.config.block_size
    src = prefill.kv_block_views(rid)
    dst = decode.kv_block_views(rid)
    for s, d in zip(src[skip:], dst[skip : len(src)], strict=True):
        d[:] = s
    prefill.release(rid)
    decode.mark_remote_kv_ready(rid, pre.output_token_ids[0])
    request = decode.get_request(rid)
    finish(decode)
    return list(request.output_token_ids)


def test_a_staged_cache_keeps_the_device_tensor_apart_from_the_views(model: LoadedModel) -> None:
    eng = engine(model, staged=True)
    assert eng.kv_cache.staged and eng.kv_cache.tensor is not eng.kv_cache.host
    eng.add_request("r", prompt(20, 1), GREEDY)
    eng.step()
    block = eng.block_ids("r")[0]
    # The step wrote the device tensor only; reading views stages out first.
    assert not torch.equal(eng.kv_cache.host[block], eng.kv_cache.tensor[block])
    views = eng.kv_block_views("r")
    assert bytes(views[0]) == eng.kv_cache.tensor[block].numpy().tobytes()


@pytest.mark.parametrize("sides", [(True, True), (True, False), (False, True)])
def test_handoffs_through_the_mirror_decode_like_colocated(
    model: LoadedModel, sides: tuple[bool, bool]
) -> None:
    tokens = prompt(45, 2)
    colocated = engine(model, staged=False)
    want = colocated.add_request("c", tokens, GREEDY)
    finish(colocated)
    prefill, decode = engine(model, sides[0]), engine(model, sides[1])
    assert handoff(prefill, decode, "x", tokens) == list(want.output_token_ids)
    assert decode.staging.num_pending == 0
    # What crossed a mirror is counted (the GPU fallback path is never silent); an unstaged
    # side reports nothing.
    blocks = -(-len(tokens) // prefill.config.block_size)
    block_bytes = prefill.kv_cache.block_bytes
    staged_out = {"out": blocks * block_bytes, "in": 0} if sides[0] else {}
    staged_in = {"out": 0, "in": blocks * block_bytes} if sides[1] else {}
    assert dict(prefill.stats().host_staged_bytes) == staged_out
    assert dict(decode.stats().host_staged_bytes) == staged_in


def test_cached_prefix_blocks_are_not_staged_in_over(model: LoadedModel) -> None:
    """The decode side's own cached prefix blocks stay as the device holds them: a mirror that
    never received them must not overwrite them (they are shared with other requests)."""
    shared = prompt(48, 3)
    first, second = shared + prompt(5, 4), shared + prompt(7, 5)
    colocated = engine(model, staged=False)
    want = colocated.add_request("c", second, GREEDY)
    finish(colocated)
    prefill, decode = engine(model, True), engine(model, True)
    handoff(prefill, decode, "a", first)
    # Garbage in the mirror of the cached blocks: staged in, it would change the tokens.
    cached = decode.cached_prefix_block_ids(second)
    assert len(cached) == 3
    for block in cached:
        decode.kv_cache.host[block].fill_(7.0)
    before = decode.stats().host_staged_bytes["in"]
    assert handoff(prefill, decode, "b", second) == list(want.output_token_ids)
    # Only the blocks it received were staged in, not its own three.
    received = -(-len(second) // decode.config.block_size) - len(cached)
    assert decode.stats().host_staged_bytes["in"] - before == received * decode.kv_cache.block_bytes


def test_an_aborted_remote_request_leaves_nothing_to_stage(model: LoadedModel) -> None:
    decode = engine(model, True)
    decode.add_remote_request("gone", prompt(30, 6), GREEDY)
    decode.kv_block_views("gone")
    assert decode.staging.num_pending == 1
    decode.abort("gone")
    assert decode.staging.num_pending == 0
