"""Turns a `SchedulerOutput` into one forward pass and one batch of sampled tokens.

It flattens the step's tokens, builds the attention metadata (slot of every new token, block
tables, context lengths), runs the model over the paged KV cache and samples one token for each
request that the step brings level, with its logprobs when asked (from the same float32
logits the sampler got). Requests collecting prompt logprobs also get the logits of every
prompt position of their chunk. It owns no request state: the scheduler advances counts and
the engine appends tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.decode_graphs import DecodeGraphs
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.logits_processing import LogitsContext, allowed_mask
from pdserve.engine.logprobs import token_logprobs
from pdserve.engine.request import Request
from pdserve.engine.sampler import SamplingRow, greedy_tokens, sample_row
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.model.attention import build_metadata
from pdserve.model.llama import LlamaModel
from pdserve.protocol.logprobs import TokenLogprobs


@dataclass(frozen=True, slots=True)
class SampledToken:
    """The token drawn for one request, with its logprobs if the request asked."""

    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass(slots=True)
class StepResult:
    """What one forward produced."""

    sampled: dict[str, SampledToken] = field(default_factory=dict)
    # request id -> (first prompt position, logprobs of the prompt tokens after it, in order).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # request id -> what its own sampling or logprobs raised (the others' rows are unaffected).
    failed: dict[str, BaseException] = field(default_factory=dict)


def _plain_greedy(request: Request) -> bool:
    """Greedy on the raw logits with no logprobs: the argmax can be taken on the device, for
    the whole batch at once."""
    p = request.sampling_params
    if p.temperature != 0.0 or p.logprobs is not None or request.grammar is not None:
        return False
    context = LogitsContext(
        p, request.prompt_token_ids, request.output_token_ids, request.stop_token_ids, None
    )
    return not context.changes_logits


def _row(request: Request) -> SamplingRow:
    p = request.sampling_params
    context = LogitsContext(
        p,
        request.prompt_token_ids,
        request.output_token_ids,
        request.stop_token_ids,
        None
        if request.grammar is None
        else allowed_mask(request.grammar.bitmask(), request.grammar.vocab_size),
    )
    return SamplingRow(
        p.temperature,
        p.top_k,
        p.top_p,
        request.seed,
        request.num_output_tokens,
        p.min_p,
        context if context.changes_logits else None,
    )


class ModelRunner:
    """Runs the model for one scheduled step."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        batch_invariant: bool = False,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        """`graphs`: decode-only steps that fit run through it (CUDA graphs on a GPU)."""
        self.model = model
        self.kv_cache = kv_cache
        self.batch_invariant = batch_invariant
        self.device = kv_cache.device
        self.graphs = graphs

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> StepResult:
        """Compute the step; returns the sampled token of every request that samples."""
        input_ids: list[int] = []
        positions: list[int] = []
        sequences: list[tuple[list[int], int, int]] = []
        logit_idx: list[int] = []
        # (request, its row in the logits) of requests that sample.
        sampling: list[tuple[Request, int]] = []
        # (request, first prompt position, number of rows, first row in the logits).
        prompt_rows: list[tuple[Request, int, int, int]] = []
        for s in out.scheduled:
            request = s.request
            start = request.num_computed_tokens
            end = start + s.num_new_tokens
            base = len(input_ids)
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            sequences.append((block_tables[request.request_id], start, end))
            if request.needs_prompt_logprobs:
                # Position p predicts prompt token p + 1; the last prompt position predicts
                # the first output token (a sampling row).
                last = min(end, request.num_prompt_tokens - 1)
                if last > start:
                    prompt_rows.append((request, start, last - start, len(logit_idx)))
                    logit_idx.extend(range(base, base + last - start))
            if s.samples:
                sampling.append((request, len(logit_idx)))
                logit_idx.append(len(input_ids) - 1)
        dev = self.device
        graphs = self.graphs
        if (
            graphs is not None
            and len(input_ids) == len(sequences)  # one new token each: decode only
            and graphs.fits(len(sequences), max(positions) + 1)
        ):
            hidden = graphs.run(input_ids, positions, [table for table, _, _ in sequences])
        else:
            meta = build_metadata(sequences, self.kv_cache.block_size, self.batch_invariant, dev)
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=dev),  # [T]
                torch.tensor(positions, dtype=torch.long, device=dev),  # [T]
                self.kv_cache.tensor,
                meta,
            )
        result = StepResult()
        if not logit_idx:
            return result
        logits = self.model.compute_logits(
            hidden[torch.tensor(logit_idx, device=dev)], self.batch_invariant
        )  # [N, vocab]
        # Plain greedy rows: one argmax for all of them, and (on a GPU) one read of the ids.
        greedy = [(request, row) for request, row in sampling if _plain_greedy(request)]
        if greedy:
            ids = greedy_tokens(logits, [row for _, row in greedy])
            for (request, _), token in zip(greedy, ids, strict=True):
                result.sampled[request.request_id] = SampledToken(token)
            sampling = [(r, row) for r, row in sampling if r.request_id not in result.sampled]
        if not sampling and not prompt_rows:
            return result
        # Everything else is per row on the host (one copy of the step's logits off a GPU).
        logits = logits.cpu()
        for request, first, count, row in prompt_rows:
            num_top = request.sampling_params.prompt_logprobs or 0
            try:
                values = [
                    token_logprobs(logits[row + i], request.token_at(first + i + 1), num_top)
                    for i in range(count)
                ]
            except Exception as exc:
                result.failed[request.request_id] = exc
                continue
            result.prompt_logprobs[request.request_id] = (first, values)
        for request, row in sampling:
            if request.request_id in result.failed:
                continue
            raw = logits[row]
            try:
                token = sample_row(raw, _row(request))
                params = request.sampling_params
                lp = None
                if params.logprobs is not None:
                    lp = token_logprobs(raw, token, params.logprobs, params.logprob_token_ids)
            except Exception as exc:
                # One request's grammar or logits processor must not fail its batch.
                result.failed[request.request_id] = exc
                continue
            result.sampled[request.request_id] = SampledToken(token, lp)
        return result

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
        dev = self.device
        meta = build_metadata([(table, position, position + 1)], bs, self.batch_invariant, dev)
        hidden = self.model(
            torch.tensor([token_id], dtype=torch.long, device=dev),  # [1]
            torch.tensor([position], dtype=torch.long, device=dev),  # [1]
            cache,
            meta,
        )
        return self.model.compute_logits(hidden, self.batch_invariant)[0]  # [vocab]
