"""What a request's parameters do to one row of logits before a token is drawn.

Applied per row, in vLLM v1's order (its `Sampler.forward`: allowed-token constraints, then
min_tokens and logit_bias, then penalties; temperature, min_p and top-k/top-p follow in
`sampler`):

1. **grammar**: tokens the structured-output grammar does not allow get -inf;
2. **min_tokens**: while fewer than `min_tokens` tokens exist, the request's stop tokens (its
   `stop_token_ids`, and EOS unless `ignore_eos`) get -inf (vLLM's MinTokensLogitsProcessor);
3. **logit_bias**: the bias is added to the token's logit (OpenAI semantics);
4. **penalties**, as vLLM's `apply_penalties` defines them (vllm/model_executor/layers/
   utils.py): for every token present in the prompt or the output, the repetition penalty
   divides a positive logit by `repetition_penalty` and multiplies a non-positive one by it;
   then `frequency_penalty * count` (occurrences in the output) and `presence_penalty`
   (once, if it occurs in the output at all) are subtracted.

Everything here is a function of the prompt and the output tokens so far (and the grammar
state, itself a function of the output tokens): a request rebuilt elsewhere from those tokens
(after a KV handoff or a migration) processes its logits exactly as the original would.
If the constraints together leave no token at all (e.g. min_tokens against a grammar that is
complete), the grammar alone decides, then the raw logits: never a row of NaNs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.protocol.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class LogitsContext:
    """What processing one row needs: the request's parameters and tokens so far."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Tokens min_tokens holds back (stop_token_ids, and EOS unless ignore_eos).
    stop_token_ids: frozenset[int]
    # [vocab] bool from the grammar; None without structured output.
    allowed: torch.Tensor | None = None

    @property
    def changes_logits(self) -> bool:
        """False when `process` would return its input unchanged."""
        p = self.params
        return (
            self.allowed is not None
            or (len(self.output_token_ids) < p.min_tokens and bool(self.stop_token_ids))
            or bool(p.logit_bias)
            or p.has_penalties
        )


def allowed_mask(bitmask: bytes, vocab_size: int) -> torch.Tensor:
    """[vocab] bool from a grammar's packed bitmask (`GrammarState.bitmask`); ids past the
    mask (a padded embedding matrix) are never allowed."""
    words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32)
    bits = (words.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    mask = bits.reshape(-1).bool()
    if mask.numel() >= vocab_size:
        return mask[:vocab_size]
    return torch.cat([mask, mask.new_zeros(vocab_size - mask.numel())])


def process(logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
    """The row `logits` ([vocab] float32) after constraints, bias and penalties (a copy)."""
    if not ctx.changes_logits:
        return logits
    vocab = logits.numel()
    out = logits.clone()
    if ctx.allowed is not None:
        out = out.masked_fill(~ctx.allowed, float("-inf"))
    constrained = out
    p = ctx.params
    if len(ctx.output_token_ids) < p.min_tokens:
        stops = [t for t in ctx.stop_token_ids if t < vocab]
        if stops:
            out = out.clone() if out is constrained else out
            out[torch.tensor(stops, dtype=torch.long)] = float("-inf")
    if p.logit_bias:
        out = out.clone() if out is constrained else out
        for token_id, bias in p.logit_bias:
            if token_id < vocab:
                out[token_id] += bias
    if p.has_penalties:
        out = _penalize(out, ctx, vocab)
    if not bool(torch.isfinite(out).any()):
        return constrained if bool(torch.isfinite(constrained).any()) else logits
    return out


def _penalize(logits: torch.Tensor, ctx: LogitsContext, vocab: int) -> torch.Tensor:
    p = ctx.params
    output = torch.tensor(list(ctx.output_token_ids), dtype=torch.long)
    counts = torch.bincount(output, minlength=vocab)[:vocab].to(logits.dtype)  # [V]
    in_output = counts > 0
    if p.repetition_penalty != 1.0:
        prompt = torch.tensor(list(ctx.prompt_token_ids), dtype=torch.long)
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[prompt[prompt < vocab]] = True
        seen |= in_output
        penalized = torch.where(
            logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty
        )
        logits = torch.where(seen, penalized, logits)
    if p.frequency_penalty != 0.0:
        logits = logits - p.frequency_penalty * counts
    if p.presence_penalty != 0.0:
        logits = logits - p.presence_penalty * in_output.to(logits.dtype)
    return logits
