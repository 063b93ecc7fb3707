"""Turns a `SchedulerOutput` into one forward pass and one batch of sampled tokens.

It flattens the step's tokens, builds the attention metadata (slot of every new token, block
tables, context lengths), runs the model over the paged KV cache and samples one token for each
request that the step brings level. It owns no request state: the scheduler advances counts.
"""

from __future__ import annotations

import torch

from pdserve.engine.kv_cache import KVCache
from pdserve.engine.sampler import SamplingRow, sample
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.model.attention import build_metadata
from pdserve.model.llama import LlamaModel


class ModelRunner:
    """Runs the model for one scheduled step."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> dict[str, int]:
        """Compute the step; returns the sampled token of every request that samples."""
        input_ids: list[int] = []
        positions: list[int] = []
        sequences: list[tuple[list[int], int, int]] = []
        logit_idx: list[int] = []
        rows: list[SamplingRow] = []
        sampled_ids: list[str] = []
        for s in out.scheduled:
            request = s.request
            start = request.num_computed_tokens
            end = start + s.num_new_tokens
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            sequences.append((block_tables[request.request_id], start, end))
            if s.samples:
                logit_idx.append(len(input_ids) - 1)
                p = request.sampling_params
                rows.append(
                    SamplingRow(
                        p.temperature, p.top_k, p.top_p, request.seed, request.num_output_tokens
                    )
                )
                sampled_ids.append(request.request_id)
        meta = build_metadata(sequences, self.kv_cache.block_size)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long),  # [T]
            torch.tensor(positions, dtype=torch.long),  # [T]
            self.kv_cache.tensor,
            meta,
        )
        if not logit_idx:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(logit_idx)])  # [N, vocab]
        return dict(zip(sampled_ids, sample(logits, rows), strict=True))

    @torch.inference_mode()
    def position_logits(self, block_table: list[int], token_id: int, position: int) -> torch.Tensor:
        """Logits [vocab] of `token_id` at `position`, attending over the KV cached for
        0..position-1 (the KV canary). The position's own K/V go to the scratch block, a copy
        of the block that holds it, so no block a request owns is written."""
        bs = self.kv_cache.block_size
        index = position // bs
        cache = self.kv_cache.tensor
        scratch = self.kv_cache.scratch_block_id
        cache[scratch].copy_(cache[block_table[index]])
        table = [*block_table[:index], scratch]
        meta = build_metadata([(table, position, position + 1)], bs)
        hidden = self.model(
            torch.tensor([token_id], dtype=torch.long),  # [1]
            torch.tensor([position], dtype=torch.long),  # [1]
            cache,
            meta,
        )
        return self.model.compute_logits(hidden)[0]  # [vocab]
