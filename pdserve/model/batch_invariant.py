"""Batch-invariant forward: a token's logits do not depend on what else the step computed.

Why: CPU GEMM kernels pick their blocking from the matrix shape, so row i of `x @ W.T` differs
in the last bits between a step of 1 token and a step of 16 (measured on MKL: every row
differs between M=1 and M=2). The same token then gets different logits when it is computed
alone, next to other requests, in a prefill chunk, after a prefix-cache hit, or recomputed
after a migration. Greedy tokens rarely change, logprobs almost always do. In this mode every
operation whose result depends on the batch shape runs on canonical shapes instead:

- **Linear layers** run on fixed tiles of `ROW_TILE` rows (the last tile zero-padded). A row's
  result depends only on the tile shape, never on the other rows or on how many tiles there
  are.
- **Attention** runs per query: the query at absolute position p attends over a key range of
  canonical length S(p) = p + 1 rounded up to `KEY_TILE`, keys after p masked. Queries with
  the same S share one SDPA call (q_len 1, batch = queries); each batch element is computed
  alone, so neither the other queries, nor chunking, nor how the KV got into the cache (prefill
  here, decode steps, a KV transfer, a recompute after migration) changes its output. Those
  calls run on one thread: how the kernel splits a batch across threads is not canonical.

Everything else (embedding, RMSNorm, RoPE, SiLU, residuals, log-softmax) is row-wise with a
fixed reduction length per row, which is already invariant. `tests/unit/engine/
test_engine_features.py` checks the property end to end (logprobs bitwise equal across batch
compositions, chunk sizes, prefix-cache hits and resumes), `tests/unit/model/
test_batch_invariant_ops.py` each operation on its own.

Cost (`docs/design-notes.md`): rows padded to a tile, one SDPA call per distinct S in a step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Rows per linear-layer call. Fixed: changing it changes every logit in the last bits.
ROW_TILE = 8
# Key lengths are rounded up to a multiple of this (one SDPA call per distinct length).
KEY_TILE = 64


def canonical_key_len(position: int) -> int:
    """Keys a query at absolute `position` attends over (masked past `position`)."""
    return -(-(position + 1) // KEY_TILE) * KEY_TILE


def linear(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` computed in fixed tiles of `ROW_TILE` rows; x [T, in] -> [T, out]."""
    num_rows = x.shape[0]
    pad = (-num_rows) % ROW_TILE
    # [T + pad, in]
    x = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x.contiguous()
    tiles = [layer(x[i : i + ROW_TILE]) for i in range(0, num_rows + pad, ROW_TILE)]
    out: torch.Tensor = torch.cat(tiles)[:num_rows]
    return out


@dataclass(slots=True)
class QueryGroup:
    """Queries of one key length S, attended in one SDPA call.

    Either all of one sequence (a prefill chunk: its keys gathered once, shared) or one query
    per sequence (decode steps of several sequences).
    """

    # [n] positions of the queries in the flattened batch.
    token_indices: torch.Tensor
    # [m, S / block_size rounded up] block tables, m == 1 (shared) or m == n (one each);
    # padded with block 0 past the sequence's blocks (masked).
    block_tables: torch.Tensor
    # [n, 1, 1, S] bool: key j visible to query i iff j <= its position.
    mask: torch.Tensor
    key_len: int


@dataclass(slots=True)
class InvariantPlan:
    """Every query of a step, grouped by canonical key length."""

    groups: list[QueryGroup]


def build_plan(sequences: list[tuple[list[int], int, int]], block_size: int) -> InvariantPlan:
    """The plan for a flattened batch of (block_table, start, end) sequences (as
    `attention.build_metadata` takes them)."""
    shared: list[QueryGroup] = []
    singles: dict[int, list[tuple[int, list[int], int]]] = {}
    query_start = 0
    for table, start, end in sequences:
        if end - start == 1:
            key_len = canonical_key_len(start)
            singles.setdefault(key_len, []).append((query_start, table, start))
        else:
            by_len: dict[int, list[int]] = {}
            for pos in range(start, end):
                by_len.setdefault(canonical_key_len(pos), []).append(pos)
            for key_len, positions in by_len.items():
                indices = [query_start + pos - start for pos in positions]
                shared.append(
                    _group(indices, [table], positions, key_len, block_size)
                )  # fmt: skip
        query_start += end - start
    for key_len, items in singles.items():
        shared.append(
            _group(
                [i for i, _, _ in items],
                [t for _, t, _ in items],
                [p for _, _, p in items],
                key_len,
                block_size,
            )
        )
    return InvariantPlan(shared)


def _group(
    indices: list[int],
    tables: list[list[int]],
    positions: list[int],
    key_len: int,
    block_size: int,
) -> QueryGroup:
    num_blocks = -(-key_len // block_size)
    padded = [(t + [0] * num_blocks)[:num_blocks] for t in tables]
    pos = torch.tensor(positions, dtype=torch.long)
    mask = (torch.arange(key_len).unsqueeze(0) <= pos.unsqueeze(1))[:, None, None, :]
    return QueryGroup(
        token_indices=torch.tensor(indices, dtype=torch.long),
        block_tables=torch.tensor(padded, dtype=torch.long),
        mask=mask,
        key_len=key_len,
    )


def attention(
    q: torch.Tensor, kv_cache: torch.Tensor, layer: int, plan: InvariantPlan, scale: float
) -> torch.Tensor:
    """Attention of q ([T, H, D]) per query over its canonical key range (see module doc)."""
    # One thread: with more, the CPU SDPA kernel's split of the work depends on the batch, and
    # so do the last bits of each element (measured: torch 2.13 on an AVX2 CPU with 2 threads,
    # element 0 of a batch of 64 differs from the same query alone by 6e-8; on one thread, never).
    with _one_thread():
        return _attention(q, kv_cache, layer, plan, scale)


# torch's thread count is per process: engines on two threads of one process take turns.
_THREADS_LOCK = threading.Lock()


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    with _THREADS_LOCK:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


def _attention(
    q: torch.Tensor, kv_cache: torch.Tensor, layer: int, plan: InvariantPlan, scale: float
) -> torch.Tensor:
    out = torch.empty_like(q)
    _, _, _, bs, kvh, hd = kv_cache.shape
    for group in plan.groups:
        flat = group.block_tables.reshape(-1)
        m, nb = group.block_tables.shape
        # [m, S, KVH, D] -> [m, KVH, S, D]
        k = kv_cache[:, layer, 0].index_select(0, flat).view(m, nb * bs, kvh, hd)
        v = kv_cache[:, layer, 1].index_select(0, flat).view(m, nb * bs, kvh, hd)
        k = k[:, : group.key_len].to(q.dtype).transpose(1, 2)
        v = v[:, : group.key_len].to(q.dtype).transpose(1, 2)
        n = group.token_indices.numel()
        if m == 1 and n > 1:
            k = k.expand(n, -1, -1, -1)
            v = v.expand(n, -1, -1, -1)
        o = F.scaled_dot_product_attention(
            q[group.token_indices].unsqueeze(2),  # [n, H, 1, D]
            k,
            v,
            attn_mask=group.mask,
            scale=scale,
            enable_gqa=True,
        )
        out[group.token_indices] = o.squeeze(2)
    return out
