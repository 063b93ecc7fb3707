"""Each operation of the batch-invariant forward on its own: a query's or a row's result is
bitwise the same alone as among others, at the thread count the process runs with (two here;
the end-to-end check is tests/unit/engine/test_engine_features.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.model import batch_invariant

BLOCK = 16
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4, 2, 32, 2


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    # The kernels' work split across threads is what made SDPA depend on the batch.
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _cache(num_blocks: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # [blocks, layers, K/V, block size, KV heads, head dim]
    return torch.randn(num_blocks, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)


@settings(max_examples=25, deadline=None)
@given(
    prompt_len=st.integers(2, 200),
    others=st.integers(1, 63),
    layer=st.integers(0, LAYERS - 1),
    seed=st.integers(0, 2**16),
)
def test_a_query_attends_bitwise_alike_alone_and_in_a_batch(
    prompt_len: int, others: int, layer: int, seed: int
) -> None:
    num_blocks = -(-(prompt_len + 64) // BLOCK)
    cache = _cache(num_blocks, seed)
    table = list(range(num_blocks))
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(prompt_len, HEADS, HEAD_DIM, generator=gen)
    scale = HEAD_DIM**-0.5
    # The whole prompt as one prefill (queries of equal key length share one SDPA call)...
    whole = batch_invariant.attention(
        q, cache, layer, batch_invariant.build_plan([(table, 0, prompt_len)], BLOCK), scale
    )
    # ... against its last query alone, as a decode step would compute it.
    last = prompt_len - 1
    alone = batch_invariant.attention(
        q[last:],
        cache,
        layer,
        batch_invariant.build_plan([(table, last, prompt_len)], BLOCK),
        scale,
    )
    assert torch.equal(whole[last], alone[0])
    # ... and as one of many decode queries of the same key length in one step.
    n = others + 1
    qs = torch.cat([q[last:], torch.randn(others, HEADS, HEAD_DIM, generator=gen)])
    plan = batch_invariant.build_plan([(table, last, last + 1)] * n, BLOCK)
    batched = batch_invariant.attention(qs, cache, layer, plan, scale)
    assert torch.equal(batched[0], alone[0])


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), row=st.integers(0, 39), seed=st.integers(0, 2**16))
def test_a_row_of_a_linear_layer_is_bitwise_alike_wherever_it_sits(
    rows: int, row: int, seed: int
) -> None:
    row %= rows
    gen = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(96, 160, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(160, 96, generator=gen))
    x = torch.randn(rows, 96, generator=gen)
    with torch.no_grad():
        many = batch_invariant.linear(layer, x)
        one = batch_invariant.linear(layer, x[row : row + 1])
    assert torch.equal(many[row], one[0])
