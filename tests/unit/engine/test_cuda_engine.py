"""The engine on a CUDA GPU: these run where one is visible (the GPU check's machine) and skip,
saying so, everywhere else (CI has none). What they pin down: a CUDA engine greedy-decodes
the tokens of the CPU engine on the tiny model, CUDA graphs change no token, a staged
handoff between two CUDA engines decodes like colocated, and the Triton kernel matches the
reference on the device."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pdserve.config import EngineConfig, ModelLoadConfig
from pdserve.engine.engine import Engine
from pdserve.model.loader import load_model
from pdserve.model.triton_attention import (
    paged_decode_attention,
    triton_available,
)
from pdserve.protocol.sampling import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: none is visible to this torch"
)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def tokens(path: Path, device: str, lengths: list[int], **kw: object) -> list[list[int]]:
    model = load_model(path, device=device)
    config = EngineConfig(model=ModelLoadConfig(path=str(path), device=device), **kw)  # type: ignore[arg-type]
    eng = Engine(model, config)
    rng = random.Random(7)
    requests = [
        eng.add_request(f"r{i}", [rng.randrange(3, 2000) for _ in range(n)], GREEDY)
        for i, n in enumerate(lengths)
    ]
    while eng.has_unfinished():
        eng.step()
    return [list(r.output_token_ids) for r in requests]


def test_cuda_greedy_tokens_equal_the_cpu_engines(tiny_model_path: Path) -> None:
    lengths = [5, 40, 17, 64]
    assert tokens(tiny_model_path, "cuda", lengths) == tokens(tiny_model_path, "cpu", lengths)


def test_cuda_graphs_change_no_token(tiny_model_path: Path) -> None:
    lengths = [3, 9, 33, 70, 18]
    with_graphs = tokens(tiny_model_path, "cuda", lengths, cuda_graphs=True)
    assert with_graphs == tokens(tiny_model_path, "cuda", lengths, cuda_graphs=False)


def test_a_staged_handoff_between_cuda_engines_decodes_like_colocated(
    tiny_model_path: Path,
) -> None:
    model = load_model(tiny_model_path, device="cuda")
    config = EngineConfig(model=ModelLoadConfig(path=str(tiny_model_path), device="cuda"))
    prompt = [random.Random(3).randrange(3, 2000) for _ in range(45)]
    colocated = Engine(model, config)
    want = colocated.add_request("c", prompt, GREEDY)
    while colocated.has_unfinished():
        colocated.step()
    prefill, decode = Engine(model, config), Engine(model, config)
    assert prefill.kv_cache.staged and prefill.kv_cache.host.is_pinned()
    first = prefill.add_request(
        "x", prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True
    )
    while prefill.has_unfinished():
        prefill.step()
    decode.add_remote_request("x", prompt, GREEDY)
    for src, dst in zip(prefill.kv_block_views("x"), decode.kv_block_views("x"), strict=False):
        dst[:] = src
    decode.mark_remote_kv_ready("x", first.output_token_ids[0])
    got = decode.get_request("x")
    while decode.has_unfinished():
        decode.step()
    assert got.output_token_ids == want.output_token_ids


@pytest.mark.skipif(not triton_available(), reason="Triton does not import")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_triton_kernel_matches_the_reference_on_the_device(dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_blocks, layers, bs, kvh, hd, heads = 40, 2, 16, 4, 128, 16
    cache = torch.randn(num_blocks, layers, 2, bs, kvh, hd, device="cuda", generator=gen)
    cache = cache.to(dtype)
    q = torch.randn(5, heads, hd, device="cuda", generator=gen).to(dtype)
    tables = torch.randperm(num_blocks - 4, device="cuda")[:30].view(5, 6).int()
    lens = torch.tensor([1, 96, 0, 37, 80], device="cuda", dtype=torch.int32)
    got = paged_decode_attention(q, cache, 1, tables, lens, hd**-0.5)
    want = paged_decode_attention(q, cache, 1, tables, lens, hd**-0.5, impl="reference")
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.count_nonzero(got[2]) == 0
