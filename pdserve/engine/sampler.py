"""Token sampling: greedy, temperature, top-k, top-p, with randomness keyed by (seed, index).

Every random draw for output token i of a request comes from a generator seeded with a hash of
(request seed, i). A request replayed anywhere (after preemption, on another decode worker after
a migration, or in a colocated run) therefore draws the same tokens given the same logits; no
RNG state has to travel with it.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) picks token t with
probability p_t, and needs one vector of noise per token, not a cumulative search.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xxhash


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs for one row of logits."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    # Index of the output token being drawn (0 for the first generated token).
    token_index: int


def draw_key(seed: int, token_index: int) -> int:
    """The generator seed for output token `token_index` of a request seeded with `seed`."""
    h = xxhash.xxh3_64(seed.to_bytes(8, "little", signed=False))
    h.update(token_index.to_bytes(8, "little", signed=False))
    return h.intdigest() & 0x7FFF_FFFF_FFFF_FFFF


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    # logits: [V] float32, already temperature-scaled.
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


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """One token id per row of `logits` ([N, vocab], float32)."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"sample: {logits.shape[0]} logit rows for {len(rows)} sampling rows")
    greedy = torch.argmax(logits, dim=-1).tolist()
    out: list[int] = []
    for i, row in enumerate(rows):
        scaled = logits[i] / row.temperature if row.temperature else logits[i]
        # A temperature so small that the scaled logits overflow float32 is greedy (its limit);
        # sampling them would draw from NaN probabilities.
        if row.temperature == 0.0 or not bool(torch.isfinite(scaled).all()):
            out.append(int(greedy[i]))
            continue
        scaled = _filter_top_k_top_p(scaled, row.top_k, row.top_p)
        probs = torch.softmax(scaled, dim=-1)
        gen = torch.Generator().manual_seed(draw_key(row.seed, row.token_index))
        noise = torch.empty_like(probs).exponential_(generator=gen)
        out.append(int(torch.argmax(probs / noise).item()))
    return out
