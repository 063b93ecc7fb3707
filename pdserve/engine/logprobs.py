"""Log-probabilities of tokens, from the raw logits the sampler was given.

As vLLM's default (`logprobs_mode="raw_logprobs"`): log_softmax, in float32, of the model's
logits before temperature, penalties, bias, grammar or top-k/top-p, so a logprob is the
model's own belief and the same whichever sampling parameters drew the token. With the
engine's batch-invariant forward (`model.batch_invariant`) the logits, and so these values,
are bitwise the same for a position however the step was batched or the KV computed.
"""

from __future__ import annotations

import torch

from pdserve.protocol.logprobs import TokenLogprobs


def token_logprobs(
    logits: torch.Tensor, token_id: int, num_top: int, wanted: tuple[int, ...] = ()
) -> TokenLogprobs:
    """Logprobs of row `logits` ([vocab] float32) for `token_id` and the `num_top` best; with
    `wanted`, for `token_id` then those tokens instead (vLLM's `logprob_token_ids`)."""
    lp = torch.log_softmax(logits, dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if wanted:
        chosen = [token_id, *(t for t in dict.fromkeys(wanted) if t != token_id)]
        top = tuple(zip(chosen, lp[chosen].tolist(), strict=True))
    elif num_top > 0:
        values, ids = torch.topk(lp, min(num_top, lp.numel()))
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(token_id, float(lp[token_id]), top)
