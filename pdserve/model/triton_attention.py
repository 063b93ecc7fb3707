"""Paged-attention decode as one Triton kernel that reads K/V in place through the block table.

`attention.paged_attention` gathers each decode sequence's blocks with `index_select` (a copy of
every cached token, every layer, every step) and then calls SDPA. On CUDA this module's kernel
reads K and V straight from the cache instead: token t of sequence b lives in block
`block_tables[b, t // block_size]` at offset `t % block_size`, so nothing is gathered. Its inputs
have static shapes (a padded batch, a fixed number of block-table columns, context lengths as a
device tensor), so the launch can be captured in a CUDA graph and replayed; a padding row with
context length 0 writes zeros.

KV layout (`kv_layout.KV_LAYOUT_VERSION` 1), one tensor per engine, any strides:

    kv_cache: [num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, head_dim]

One program per (sequence, KV head) attends with all the H / KVH query heads that share that KV
head (transformers' repeat_kv pairing: query head h uses KV head h // (H / KVH)), so each K/V
row is read once. It walks the context in tiles of BLOCK_N tokens with an online softmax
(running max and sum, flash-decoding style, without splitting one sequence across programs)
and computes in float32 whatever the dtypes of q and the cache.

`paged_decode_attention(..., impl="reference")` is the same contract in plain PyTorch, one sequence at a time: the
oracle of the tests and the fallback where the kernel cannot run (no Triton, or CPU tensors).

Verification: its numbers were checked on CPU only, through Triton's interpreter
(`TRITON_INTERPRET=1`, Triton 3.9, against the reference and `attention.paged_attention`). It
was also compiled for sm_90 (cubin, no register spills) on a machine without a GPU, but it has
never run on one: its speed and its behaviour under CUDA graph capture are unverified.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

import torch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_HEAD_DIM = 256
# Context tokens per loop iteration; tl.dot needs every dimension >= 16. With 16 (and 8 warps
# past head_dim 128) sm_90 builds spill no registers, up to 32 query heads per KV head.
_BLOCK_N = 16

# triton.language, bound by `_kernel()` on first use: the kernel's body resolves `tl` here.
tl: Any = None
_cached_kernel: Any = None


def triton_available() -> bool:
    """Whether Triton imports (the first call imports it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kernel() -> Any:
    """The jitted kernel, defined on first call so that importing this module needs no Triton."""
    global tl, _cached_kernel
    if _cached_kernel is not None:
        return _cached_kernel
    import triton
    import triton.language

    tl = triton.language

    @triton.jit
    def decode_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
        q_ptr, kv_ptr, table_ptr, lens_ptr, out_ptr,
        layer, scale,
        s_qb, s_qh, s_qd,
        s_block, s_layer, s_kv, s_tok, s_head, s_d,
        s_tb, s_tn, s_len,
        s_ob, s_oh, s_od,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        context_len = tl.load(lens_ptr + seq * s_len)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        mask_h = offs_h < GROUP
        mask_d = offs_d < HEAD_DIM
        heads = kv_head * GROUP + offs_h
        q_mask = mask_h[:, None] & mask_d[None, :]
        q_ptrs = q_ptr + seq * s_qb + heads[:, None] * s_qh + offs_d[None, :] * s_qd
        q = tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]

        k_base = kv_ptr + layer * s_layer + kv_head * s_head  # within one block: int32 is enough
        table_row = table_ptr + seq * s_tb
        row_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for start in range(0, context_len, BLOCK_N):
            tok = start + offs_n  # [BLOCK_N]
            mask_n = tok < context_len
            block = tl.load(table_row + (tok // BLOCK_SIZE) * s_tn, mask=mask_n, other=0)
            row = block.to(tl.int64) * s_block + (tok % BLOCK_SIZE) * s_tok
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k_ptrs = k_base + row[:, None] + offs_d[None, :] * s_d  # [BLOCK_N, BLOCK_D]
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(k_ptrs + s_kv, mask=kv_mask, other=0.0).to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_H, BLOCK_N]
            scores = tl.where(mask_n[None, :], scores, float("-inf"))
            new_max = tl.maximum(row_max, tl.max(scores, 1))
            rescale = tl.exp(row_max - new_max)  # 0 on the first tile (row_max is -inf)
            p = tl.exp(scores - new_max[:, None])
            row_sum = row_sum * rescale + tl.sum(p, 1)
            acc = acc * rescale[:, None] + tl.dot(p, v, input_precision=PRECISION)
            row_max = new_max
        # context_len 0 (a padding row): acc is 0 and row_sum 0; divide by 1 to write zeros.
        o = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
        o_ptrs = out_ptr + seq * s_ob + heads[:, None] * s_oh + offs_d[None, :] * s_od
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=q_mask)

    _cached_kernel = decode_kernel
    return decode_kernel


def _check(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Raise ValueError naming the first argument that breaks the contract."""
    if q.dim() != 3 or q.dtype not in _DTYPES:
        raise ValueError(f"q must be [B, H, D] float32/bfloat16/float16, got {q.dtype} {q.shape}")
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2 or kv_cache.dtype not in _DTYPES:
        raise ValueError(
            "kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] "
            f"float32/bfloat16/float16, got {kv_cache.dtype} {kv_cache.shape}"
        )
    batch, num_heads, head_dim = q.shape
    _, num_layers, _, block_size, num_kv_heads, kv_head_dim = kv_cache.shape
    if kv_head_dim != head_dim or head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"kv_cache head_dim {kv_head_dim} must equal q's {head_dim} (<= 256)")
    if num_heads % num_kv_heads:
        raise ValueError(f"q's {num_heads} heads are not a multiple of {num_kv_heads} KV heads")
    if block_size & (block_size - 1):
        raise ValueError(f"kv_cache block_size {block_size} must be a power of two")
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer} is outside kv_cache's {num_layers} layers")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [{batch}, max_blocks], got {block_tables.shape}")
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens must be [{batch}], got {context_lens.shape}")
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out must be {q.dtype} {q.shape}, got {out.dtype} {out.shape}")
    others = {"kv_cache": kv_cache, "block_tables": block_tables, "context_lens": context_lens}
    if out is not None:
        others["out"] = out
    for name, t in others.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    impl: Literal["auto", "reference"] = "auto",
) -> torch.Tensor:
    """Attention of one query token per sequence (q [B, H, D]) over its cached K/V in `layer`.

    block_tables [B, max_blocks] int32 (padding entries must still be valid block ids),
    context_lens [B] int32 (tokens to attend, at most max_blocks * block_size; 0 writes zeros).
    Returns [B, H, D] in q's dtype, written into `out` when given. `auto` runs the Triton kernel
    on CUDA tensors (or any tensors under TRITON_INTERPRET=1) and the reference otherwise;
    `reference` always runs the reference (plain PyTorch, one sequence at a time, float32).
    """
    _check(q, kv_cache, layer, block_tables, context_lens, out)
    if impl == "reference" or not (q.is_cuda or _interpreting()) or not triton_available():
        return _reference(q, kv_cache, layer, block_tables, context_lens, scale, out)
    if out is None:
        out = torch.empty_like(q)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[3], kv_cache.shape[4]
    group = num_heads // num_kv_heads
    # 16-bit q and K/V are exact in TF32, and TF32 rounds only the softmax weights there;
    # float32 inputs get full-precision products.
    exact = torch.float32 in (q.dtype, kv_cache.dtype)
    launch: Callable[..., Any] = _kernel()[(batch, num_kv_heads)]
    launch(
        q, kv_cache, block_tables, context_lens, out,
        layer, scale,
        *q.stride(), *kv_cache.stride(), *block_tables.stride(), context_lens.stride(0),
        *out.stride(),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=max(16, _next_pow2(group)), BLOCK_D=max(16, _next_pow2(head_dim)),
        BLOCK_N=_BLOCK_N, PRECISION="ieee" if exact else "tf32",
        num_warps=4 if head_dim <= 128 else 8,
    )  # fmt: skip
    return out


def _reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
) -> torch.Tensor:
    # Checked by the caller; one sequence at a time, in float32.
    if out is None:
        out = torch.empty_like(q)
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = cache.shape[3], cache.shape[4]
    for b in range(batch):
        n = int(lens[b])
        if n == 0:
            out[b] = 0
            continue
        if n > tables.shape[1] * block_size:
            raise ValueError(f"context_lens[{b}] = {n} exceeds its block table")
        blocks = tables[b, : -(-n // block_size)].long()
        kv = cache[blocks, layer].float()  # [nb, 2, bs, KVH, D]
        k = kv[:, 0].reshape(-1, num_kv_heads, head_dim)[:n]  # [n, KVH, D]
        v = kv[:, 1].reshape(-1, num_kv_heads, head_dim)[:n]
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [n, H, D], h -> h // group
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale  # [H, n]
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    return out


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
