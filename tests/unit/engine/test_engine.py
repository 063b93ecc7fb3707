"""Engine on the tiny model: exactness across chunking, prefix caching, preemption, and the
disaggregation hooks (held KV copied into another engine's remote allocation)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdserve.config import EngineConfig, ModelLoadConfig
from pdserve.engine.engine import Engine
from pdserve.errors import ConfigError, PromptTooLong
from pdserve.model.loader import LoadedModel, load_model
from pdserve.protocol.sampling import SamplingParams


@pytest.fixture(scope="module")
def model(tiny_model_path: Path) -> LoadedModel:
    return load_model(str(tiny_model_path))


def engine(model: LoadedModel, **kw: object) -> Engine:
    return Engine(model, EngineConfig(model=ModelLoadConfig(path=str(model.path)), **kw))  # type: ignore[arg-type]


def run(eng: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    reqs = [
        eng.add_request(f"r{i}", p, sp)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    while eng.has_unfinished():
        eng.step()
    return [list(r.output_token_ids) for r in reqs]


def prompts(model: LoadedModel, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in lengths]


def assert_idle(eng: Engine) -> None:
    eng.block_manager.check_invariants()
    s = eng.stats()
    assert (s.num_free_blocks, s.num_held_blocks, s.num_running, s.num_waiting) == (
        s.num_blocks,
        0,
        0,
        0,
    )


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_batched_equals_one_at_a_time(model: LoadedModel) -> None:
    ps = prompts(model, [5, 37, 1, 70])
    alone = [run(engine(model), [p], [GREEDY])[0] for p in ps]
    together = run(engine(model), ps, [GREEDY] * 4)
    assert together == alone


def test_chunked_prefill_gives_the_same_tokens(model: LoadedModel) -> None:
    ps = prompts(model, [90, 45, 7])
    whole = run(engine(model, max_num_batched_tokens=2048), ps, [GREEDY] * 3)
    chunked_engine = engine(model, max_num_batched_tokens=16)
    chunked = run(chunked_engine, ps, [GREEDY] * 3)
    assert chunked == whole
    assert_idle(chunked_engine)


def test_prefix_cache_hit_gives_the_same_tokens_and_reports_hits(model: LoadedModel) -> None:
    shared = prompts(model, [64], seed=1)[0]
    a, b = [*shared, 5, 6, 7], [*shared, 9, 10]
    cold = run(engine(model, enable_prefix_caching=False), [b], [GREEDY])[0]
    eng = engine(model)
    run(eng, [a], [GREEDY])
    r = eng.add_request("warm-b", b, GREEDY)
    while eng.has_unfinished():
        eng.step()
    assert r.output_token_ids == cold
    assert r.num_cached_tokens == 64
    assert eng.stats().prefix_cache_hit_tokens == 64
    assert_idle(eng)


def test_preemption_under_a_tiny_pool_completes_with_the_same_tokens(model: LoadedModel) -> None:
    ps = prompts(model, [20, 30, 25, 18], seed=2)
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 4
    reference = run(engine(model), ps, params)
    small = engine(model, block_size=16, num_blocks=8)
    reqs = [
        small.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, params, strict=True))
    ]
    while small.has_unfinished():
        small.step()
    assert [r.output_token_ids for r in reqs] == reference
    assert sum(r.num_preemptions for r in reqs) > 0  # the pool really was too small
    assert_idle(small)


def test_seeded_sampling_replays_and_survives_preemption(model: LoadedModel) -> None:
    ps = prompts(model, [20, 30, 25, 18], seed=3)
    params = [
        SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=s, ignore_eos=True)
        for s in range(4)
    ]
    first = run(engine(model), ps, params)
    again = run(engine(model, block_size=16, num_blocks=8), ps, params)
    assert again == first
    other = run(
        engine(model),
        ps,
        [SamplingParams(max_tokens=20, temperature=0.9, seed=99, ignore_eos=True)] * 4,
    )
    assert other != first


def test_stop_token_ids_end_a_request_and_stop_strings_are_not_the_engines(
    model: LoadedModel,
) -> None:
    p = prompts(model, [10], seed=4)[0]
    eng = engine(model)
    free = run(eng, [p], [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)])[0]
    text = model.tokenizer.decode(free)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    # Stop strings are applied over the text by whoever detokenizes (router, `LLM`): the
    # engine runs on to max_tokens, and no step of it decodes an output.
    r = eng.add_request(
        "s", p, SamplingParams(max_tokens=16, temperature=0.0, stop=(stop,), ignore_eos=True)
    )
    while eng.has_unfinished():
        eng.step()
    assert r.status.finish_reason == "length" and r.output_token_ids == free
    r2 = eng.add_request(
        "t",
        p,
        SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=(free[3],), ignore_eos=True),
    )
    while eng.has_unfinished():
        eng.step()
    assert r2.output_token_ids == free[: free.index(free[3]) + 1]
    assert_idle(eng)


def test_bad_requests_get_typed_errors(model: LoadedModel) -> None:
    eng = engine(model)
    with pytest.raises(PromptTooLong, match="context of"):
        eng.add_request("long", [5] * model.config.max_position_embeddings, GREEDY)
    with pytest.raises(PromptTooLong, match="empty"):
        eng.add_request("empty", [], GREEDY)
    with pytest.raises(ConfigError, match="outside"):
        eng.add_request("bad", [model.config.vocab_size + 5], GREEDY)
    assert_idle(eng)


def test_held_kv_moved_into_a_remote_allocation_decodes_like_colocated(model: LoadedModel) -> None:
    """The disaggregation hooks end to end without sockets: prefill on one engine with held KV,
    byte-copy its blocks into another engine's remote allocation, decode there."""
    p = prompts(model, [41], seed=5)[0]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    colocated = run(engine(model), [p], [params])[0]

    prefill = engine(model)
    pre = prefill.add_request(
        "x", p, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), hold_kv=True
    )
    while prefill.has_unfinished():
        prefill.step()
    assert prefill.stats().num_held_blocks == 3
    first = pre.output_token_ids[0]

    decode = engine(model)
    run(decode, prompts(model, [33], seed=6), [GREEDY])  # make its free list differ
    assert decode.add_remote_request("x", p, params) == 0
    assert not decode.has_work()
    src = b"".join(bytes(v) for v in prefill.kv_block_views("x"))
    dst = decode.kv_block_views("x")
    offset = 0
    for view in dst:  # the remote allocation has one slot more than the prompt needs
        n = min(len(view), len(src) - offset)
        view[:n] = src[offset : offset + n]
        offset += n
    assert offset == len(src)
    assert prefill.release("x") == 3
    assert_idle(prefill)
    decode.mark_remote_kv_ready("x", first)
    r = decode.get_request("x")
    while decode.has_unfinished():
        decode.step()
    assert r.output_token_ids == colocated
    assert_idle(decode)


def test_block_views_share_memory_with_the_cache(model: LoadedModel) -> None:
    eng = engine(model)
    eng.add_request("v", [5] * 20, GREEDY)
    eng.step()
    views = eng.kv_block_views("v")
    assert sum(len(v) for v in views) == 2 * eng.kv_cache.block_bytes
    block = eng.block_ids("v")[0]
    views[0][0:4] = b"\x00\x00\x80\x3f"  # float32 1.0, little-endian
    assert eng.kv_cache.tensor[block].flatten()[0].item() == 1.0
