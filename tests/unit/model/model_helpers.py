"""Helpers shared by the model tests: a paged greedy decoder (checkpoints: `checkpoints.py`)."""

from __future__ import annotations

import torch
from checkpoints import randomize_, save_hf_checkpoint

from pdserve.model.attention import build_metadata, contiguous_metadata
from pdserve.model.llama import LlamaModel


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| over all elements (both cast to float64)."""
    a, b = actual.double(), expected.double()
    return float((a - b).abs().max() / b.abs().max())


def prefill_logits(module: LlamaModel, prompts: list[list[int]], block_size: int) -> torch.Tensor:
    """Logits [sum(len), vocab] of every prompt position, all prompts in one flattened step."""
    lengths = [len(p) for p in prompts]
    meta, num_blocks = contiguous_metadata(lengths, lengths, block_size)
    kv = kv_cache_for(module, num_blocks, block_size)
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)  # [T]
    positions = torch.cat([torch.arange(n) for n in lengths])  # [T]
    return module.compute_logits(module(ids, positions, kv, meta))


def kv_cache_for(module: LlamaModel, num_blocks: int, block_size: int) -> torch.Tensor:
    """A zeroed paged KV cache for the module's shapes, in its parameter dtype."""
    c = module.config
    dtype = module.norm.weight.dtype
    # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    return torch.zeros(
        num_blocks, c.num_layers, 2, block_size, c.num_kv_heads, c.head_dim, dtype=dtype
    )


def paged_greedy(
    module: LlamaModel, prompts: list[list[int]], max_new_tokens: int, block_size: int = 4
) -> list[list[int]]:
    """Greedy tokens per prompt: one batched prefill, then batched one-token decode steps.

    Each sequence gets its own blocks, drawn from a shuffled pool, so the block tables are not
    contiguous and the decode path gathers across scattered blocks.
    """
    need = [-(-(len(p) + max_new_tokens) // block_size) for p in prompts]
    pool = torch.randperm(sum(need), generator=torch.Generator().manual_seed(1)).tolist()
    tables, start = [], 0
    for n in need:
        tables.append(pool[start : start + n])
        start += n
    kv = kv_cache_for(module, sum(need), block_size)
    lengths = [len(p) for p in prompts]
    meta = build_metadata([(t, 0, n) for t, n in zip(tables, lengths, strict=True)], block_size)
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)  # [T]
    positions = torch.cat([torch.arange(n) for n in lengths])  # [T]
    last = torch.tensor(lengths).cumsum(0) - 1  # [B] index of each prompt's last token
    hidden = module(ids, positions, kv, meta)
    tokens = module.compute_logits(hidden[last]).argmax(-1)  # [B]
    out = [[int(t)] for t in tokens]
    for step in range(max_new_tokens - 1):
        seqs = [(t, n + step, n + step + 1) for t, n in zip(tables, lengths, strict=True)]
        meta = build_metadata(seqs, block_size)
        positions = torch.tensor([n + step for n in lengths])  # [B]
        hidden = module(tokens, positions, kv, meta)
        tokens = module.compute_logits(hidden).argmax(-1)  # [B]
        for row, t in zip(out, tokens, strict=True):
            row.append(int(t))
    return out


__all__ = [
    "kv_cache_for",
    "paged_greedy",
    "prefill_logits",
    "randomize_",
    "relative_error",
    "save_hf_checkpoint",
]
