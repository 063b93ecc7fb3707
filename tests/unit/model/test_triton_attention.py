"""The Triton paged-decode kernel against its PyTorch reference and pdserve's own attention.

On CPU tensors the kernel runs only under Triton's interpreter, which TRITON_INTERPRET=1 turns
on for the whole process once Triton defines the kernel. So the kernel cases (`CASES`) run in one
child process, this file run as a script, which reports each case's traceback or None; the
parent never sets the variable, and nothing leaks into other tests. The reference, the CPU
fallback and the argument checks run in this process and need no Triton.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_interpreter import errors_in_interpreter, report

from pdserve.model.attention import build_metadata, paged_attention
from pdserve.model.triton_attention import paged_decode_attention

# The plain-PyTorch reference, the contract the kernel is checked against.
reference = functools.partial(paged_decode_attention, impl="reference")


@dataclass(slots=True)
class Problem:
    q: torch.Tensor  # [B, H, D]
    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, block_size, KVH, D]
    layer: int
    block_tables: torch.Tensor  # [B, max_blocks] int32, shuffled block ids
    context_lens: torch.Tensor  # [B] int32
    scale: float


def make_problem(
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    q_dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype = torch.float32,
    num_layers: int = 2,
    layer: int = 1,
    seed: int = 0,
) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(1, *(-(-n // block_size) for n in context_lens))
    num_blocks = len(context_lens) * max_blocks + 3  # a few blocks no sequence owns
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=gen).to(kv_dtype)
    # Distinct block ids in random order; a table's columns past its context are other
    # sequences' blocks, as padding may be.
    ids = torch.randperm(num_blocks, generator=gen)[: len(context_lens) * max_blocks]
    return Problem(
        q=torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to(q_dtype),
        kv_cache=kv_cache,
        layer=layer,
        block_tables=ids.view(len(context_lens), max_blocks).to(torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        scale=head_dim**-0.5,
    )


def run(fn: Callable[..., torch.Tensor], p: Problem, **kwargs: torch.Tensor) -> torch.Tensor:
    return fn(p.q, p.kv_cache, p.layer, p.block_tables, p.context_lens, p.scale, **kwargs)


def pdserve_decode(p: Problem) -> torch.Tensor:
    """`attention.paged_attention` on the rows with context (one new token each)."""
    block_size = p.kv_cache.shape[3]
    lens = p.context_lens.tolist()
    sequences = [(p.block_tables[b].tolist(), n - 1, n) for b, n in enumerate(lens) if n > 0]
    meta = build_metadata(sequences, block_size)
    return paged_attention(p.q[p.context_lens > 0], p.kv_cache, p.layer, meta, p.scale)


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, p: Problem, loose: bool = False
) -> None:
    assert actual.dtype == p.q.dtype and actual.shape == expected.shape
    # bfloat16 anywhere: about one bfloat16 ulp (the interpreter truncates where torch rounds);
    # `loose` when the other side also computes in bfloat16 (pdserve's SDPA).
    if torch.bfloat16 in (p.q.dtype, p.kv_cache.dtype):
        tol = 4e-2 if loose else 1.6e-2
    elif torch.float16 in (p.q.dtype, p.kv_cache.dtype):
        tol = 2e-3
    else:
        tol = 1e-5
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


# -- Kernel cases: run in the child process, under the interpreter. --

CASES: dict[str, Callable[[], None]] = {}


def case(fn: Callable[[], None]) -> Callable[[], None]:
    CASES[fn.__name__] = fn
    return fn


DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


@case
@settings(max_examples=40, deadline=None, database=None)
@given(
    context_lens=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    num_kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([16, 40, 64, 128]),
    block_size=st.sampled_from([1, 4, 16]),
    q_dtype=DTYPES,
    kv_dtype=DTYPES,
    layer=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def kernel_matches_reference(
    context_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    layer: int,
    seed: int,
) -> None:
    p = make_problem(
        context_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size,
        q_dtype, kv_dtype, num_layers=3, layer=layer, seed=seed,
    )  # fmt: skip
    assert_close(run(paged_decode_attention, p), run(reference, p), p)


@case
def kernel_matches_pdserve_attention() -> None:
    shapes = [(4, 4, 16, 1), (6, 2, 64, 4), (8, 2, 128, 16), (3, 1, 64, 16)]  # H, KVH, D, bs
    for dtype in (torch.float32, torch.bfloat16):
        for num_heads, num_kv_heads, head_dim, block_size in shapes:
            lens = [1, 37, 0, 16, 5]
            p = make_problem(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, dtype)
            out = run(paged_decode_attention, p)
            assert_close(out[p.context_lens > 0], pdserve_decode(p), p, loose=True)
            assert torch.equal(out[2], torch.zeros_like(out[2]))


@case
def padding_rows_write_zeros_into_out() -> None:
    p = make_problem([0, 9, 0], 4, 2, 16, 4)
    out = torch.full_like(p.q, float("nan"))
    assert run(paged_decode_attention, p, out=out) is out
    assert not out.isnan().any()
    assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
    assert_close(out, run(reference, p), p)


@case
def strided_views_read_in_place() -> None:
    # Every argument a non-contiguous view: the kernel must use their strides.
    p = make_problem([7, 0, 21], 4, 2, 16, 4, num_layers=3, layer=2)
    expected = run(reference, p)
    wide_q = torch.zeros(3, 4, 32)
    wide_q[:, :, ::2] = p.q
    wide_kv = torch.zeros(*p.kv_cache.shape[:-1], 48)
    wide_kv[..., 8:40:2] = p.kv_cache
    wide_tables = torch.full((3, 2 * p.block_tables.shape[1]), -1, dtype=torch.int32)
    wide_tables[:, ::2] = p.block_tables
    wide_lens = torch.zeros(6, dtype=torch.int32)
    wide_lens[1::2] = p.context_lens
    out = torch.empty(4, 3, 16).transpose(0, 1)
    strided = Problem(
        wide_q[:, :, ::2], wide_kv[..., 8:40:2], 2, wide_tables[:, ::2], wide_lens[1::2], p.scale
    )
    assert run(paged_decode_attention, strided, out=out) is out
    assert_close(out, expected, p)


@pytest.fixture(scope="module")
def interpreter_errors() -> dict[str, str | None]:
    return errors_in_interpreter(__file__)


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_in_interpreter(name: str, interpreter_errors: dict[str, str | None]) -> None:
    error = interpreter_errors[name]
    assert error is None, error


# -- In this process, without Triton. --


@settings(max_examples=30, deadline=None)
@given(
    context_lens=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    group=st.sampled_from([1, 3, 4]),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_reference_matches_pdserve_attention(
    context_lens: list[int], group: int, block_size: int, seed: int
) -> None:
    p = make_problem(context_lens, 2 * group, 2, 16, block_size, seed=seed)
    assert_close(run(reference, p), pdserve_decode(p), p)


def test_cpu_tensors_fall_back_to_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    p = make_problem([3, 0, 12], 4, 2, 16, 4, q_dtype=torch.bfloat16)
    assert torch.equal(run(paged_decode_attention, p), run(reference, p))


def test_module_imports_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from pdserve.model import triton_attention as t\n"
        "assert not t.triton_available()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _bad(**changes: object) -> dict[str, object]:
    p = make_problem([3, 5], 4, 2, 16, 4)
    args: dict[str, object] = {
        "q": p.q,
        "kv_cache": p.kv_cache,
        "layer": p.layer,
        "block_tables": p.block_tables,
        "context_lens": p.context_lens,
        "scale": p.scale,
    }
    return args | changes


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("q", _bad(q=torch.zeros(2, 4, 16, dtype=torch.float64))),
        ("q", _bad(q=torch.zeros(2, 3, 16))),  # 3 heads over 2 KV heads
        ("kv_cache", _bad(kv_cache=torch.zeros(8, 2, 2, 4, 2, 32))),
        ("block_size", _bad(kv_cache=torch.zeros(8, 2, 2, 3, 2, 16))),
        ("layer", _bad(layer=2)),
        ("block_tables", _bad(block_tables=torch.zeros(2, 2, dtype=torch.int64))),
        ("block_tables", _bad(block_tables=torch.zeros(3, 2, dtype=torch.int32))),
        ("context_lens", _bad(context_lens=torch.tensor([3, 5]))),
        ("out", _bad(out=torch.zeros(2, 4, 16, dtype=torch.bfloat16))),
    ],
)
def test_bad_arguments_name_themselves(name: str, args: dict[str, object]) -> None:
    for fn in (paged_decode_attention, reference):
        with pytest.raises(ValueError, match=name):
            fn(**args)


if __name__ == "__main__":  # the child: TRITON_INTERPRET=1 was set before anything imported
    report(CASES)
