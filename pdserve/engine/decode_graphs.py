"""Decode-only steps as CUDA graphs, one per padded batch size.

A decode step on a GPU is dozens of small kernels per layer whose launch cost, not arithmetic,
decides the step time at small batches. Capturing the whole forward of a decode-only step once
per batch size (1, 2, 4, ... up to `max_batch`) and replaying it removes that cost. A graph
replays fixed addresses and shapes, so every input lives in a static buffer: token ids,
positions, the slot each new K/V goes to, block tables padded to the longest context the
engine allows, and context lengths. A step of n sequences runs the graph of the smallest
captured size b >= n; the b - n padding rows have context length 0 (attention outputs zeros
for them) and write their K/V into the cache's scratch block, which no request owns.

Attention inside the graph is the paged decode kernel (`model.triton_attention`), which reads
the block table in place and stops at each row's context length, so a table padded to the
maximum costs nothing. With `capture=False` the same static path runs eagerly (the CPU: the
gather path with a mask from the context lengths): tests check on the CPU that padding,
bucketing and the scratch slots give the tokens of the normal path. The capture itself only
runs on CUDA.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from pdserve.config import EngineConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.model.attention import AttentionMetadata, DecodeGroup
from pdserve.model.llama import LlamaModel
from pdserve.model.triton_attention import triton_available

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


class DecodeGraphs:
    """Static-shape decode forwards, captured as CUDA graphs when `capture`."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        max_model_len: int,
        max_batch: int = 128,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.sizes = [b for b in BATCH_SIZES if b <= max_batch] or [max_batch]
        self.max_batch = self.sizes[-1]
        self.max_blocks = -(-max_model_len // kv_cache.block_size)
        n, dev = self.max_batch, self.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_block = torch.full((n,), kv_cache.scratch_block_id, dtype=torch.long, device=dev)
        self.slot_offset = torch.zeros(n, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, device=dev)
        # batch size -> (graph, its output buffer); empty until `capture_all`.
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self._capture = capture and self.device.type == "cuda"

    def fits(self, num_seqs: int, max_context: int) -> bool:
        """Whether a decode-only step of this shape can run here."""
        return (
            num_seqs <= self.max_batch and max_context <= self.max_blocks * self.kv_cache.block_size
        )

    def capture_all(self) -> None:
        """Capture one graph per batch size, largest first so smaller ones reuse its memory
        pool. Each size runs eagerly first: Triton compiles its kernel outside the capture."""
        if not self._capture:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in self.sizes:
                self._forward(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size)
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def run(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Hidden states [n, hidden] of one decode token per sequence: token i at positions[i]
        attends to positions 0..positions[i] of the sequence whose block table is tables[i]."""
        n = len(tokens)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        bs = self.kv_cache.block_size
        table_rows = torch.zeros(size, self.max_blocks, dtype=torch.int32)
        for i, table in enumerate(tables):
            table_rows[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        pad = size - n
        blocks = [table[p // bs] for table, p in zip(tables, positions, strict=True)]
        staged = (
            (self.input_ids, torch.tensor(tokens + [0] * pad)),
            (self.positions, torch.tensor(positions + [0] * pad)),
            (self.slot_block, torch.tensor(blocks + [self.kv_cache.scratch_block_id] * pad)),
            (self.slot_offset, torch.tensor([p % bs for p in positions] + [0] * pad)),
            (self.context_lens, torch.tensor([p + 1 for p in positions] + [0] * pad)),
            (self.block_tables, table_rows),
        )
        for buffer, values in staged:
            buffer[:size].copy_(values, non_blocking=True)
        captured = self._graphs.get(size)
        if captured is None:
            return self._forward(size)[:n]
        graph, out = captured
        graph.replay()
        return out[:n]

    def _forward(self, size: int) -> torch.Tensor:
        lens = self.context_lens[:size]
        mask = None
        if self.device.type != "cuda":
            # The gather path attends over the whole padded table: hide what lies past each
            # row's context (the kernel stops there by itself).
            width = self.max_blocks * self.kv_cache.block_size
            mask = (torch.arange(width, device=self.device)[None, :] < lens[:, None])[
                :, None, None, :
            ]
        group = DecodeGroup(
            token_indices=self.rows[:size],
            block_tables=self.block_tables[:size],
            mask=mask,
            context_lens=lens,
        )
        meta = AttentionMetadata(
            slot_block=self.slot_block[:size],
            slot_offset=self.slot_offset[:size],
            prefills=[],
            decode_groups=[group],
        )
        out: torch.Tensor = self.model(
            self.input_ids[:size], self.positions[:size], self.kv_cache.tensor, meta
        )
        return out


def capture_decode_graphs(
    model: LlamaModel, kv_cache: KVCache, config: EngineConfig, max_model_len: int
) -> DecodeGraphs | None:
    """Decode graphs for an engine on a GPU, captured now; None on the CPU, when turned off
    (`cuda_graphs`), in batch-invariant mode, or without the Triton kernel."""
    if (
        kv_cache.device.type != "cuda"
        or not config.cuda_graphs
        or config.batch_invariant
        or not triton_available()
    ):
        return None
    graphs = DecodeGraphs(model, kv_cache, max_model_len, config.max_num_seqs)
    graphs.capture_all()
    return graphs
