"""Token sampling: greedy, temperature, min-p, top-k, top-p, with randomness keyed by
(seed, index).

Every random draw for output token i of a request comes from a generator seeded with a hash of
(request seed, i). A request replayed anywhere (after preemption, on another decode worker after
a migration, or in a colocated run) therefore draws the same tokens given the same logits; no
RNG state has to travel with it.

Each row is first processed for its request (`logits_processing`: grammar, min_tokens,
logit_bias, penalties), then, in vLLM v1's order: greedy takes the argmax; otherwise the row
is divided by the temperature, min_p drops tokens whose probability is below min_p times the
best token's (vLLM's `apply_min_p`), top-k and top-p filter, and the exponential race
argmax(p / E) with E ~ Exp(1) picks token t with probability p_t, with one vector of noise per
token and no cumulative search. Rows are handled one at a time, so a row's token never depends
on the other rows of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash

from pdserve.engine.logits_processing import LogitsContext, process


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs for one row of logits."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    # Index of the output token being drawn (0 for the first generated token).
    token_index: int
    min_p: float = 0.0
    # Per-request processing (penalties, bias, min_tokens, grammar); None: the raw row.
    context: LogitsContext | None = None


def draw_key(seed: int, token_index: int) -> int:
    """The generator seed for output token `token_index` of a request seeded with `seed`."""
    h = xxhash.xxh3_64(seed.to_bytes(8, "little", signed=False))
    h.update(token_index.to_bytes(8, "little", signed=False))
    return h.intdigest() & 0x7FFF_FFFF_FFFF_FFFF


def _filter(logits: torch.Tensor, min_p: float, top_k: int, top_p: float) -> torch.Tensor:
    # logits: [V] float32, already temperature-scaled.
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        # Spelled out: a top_p below float32's resolution compares as 0 and would drop it too.
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_row(logits: torch.Tensor, row: SamplingRow) -> int:
    """The token drawn from one row of logits ([vocab] float32)."""
    if row.context is not None:
        logits = process(logits, row.context)
    if row.temperature == 0.0:
        return int(torch.argmax(logits).item())
    scaled = logits / row.temperature
    # A temperature so small that the scaled logits overflow float32 is greedy (its limit):
    # softmax over +inf draws from NaN probabilities. (-inf is a masked token, kept.)
    if bool(torch.isposinf(scaled).any()) or bool(torch.isnan(scaled).any()):
        return int(torch.argmax(logits).item())
    scaled = _filter(scaled, row.min_p, row.top_k, row.top_p)
    probs = torch.softmax(scaled, dim=-1)
    gen = torch.Generator().manual_seed(draw_key(row.seed, row.token_index))
    noise = torch.empty_like(probs).exponential_(generator=gen)
    return int(torch.argmax(probs / noise).item())


def greedy_tokens(logits: torch.Tensor, rows: list[int]) -> list[int]:
    """The argmax token of each of these rows of `logits` ([N, vocab], on any device): one
    batched argmax and one read of the ids, for rows that are greedy on their raw logits."""
    index = torch.tensor(rows, device=logits.device)
    return [int(t) for t in logits.index_select(0, index).argmax(dim=-1).tolist()]


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """One token id per row of `logits` ([N, vocab], float32)."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"sample: {logits.shape[0]} logit rows for {len(rows)} sampling rows")
    return [sample_row(logits[i], row) for i, row in enumerate(rows)]
