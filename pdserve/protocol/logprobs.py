"""A position's log-probabilities as the engine reports them and the router formats them.

Computed by `pdserve.engine.logprobs` (torch); this type carries no torch so that the wire
models and the router can hold it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One position: the chosen token's logprob and the most likely alternatives."""

    token_id: int
    logprob: float
    # (token id, logprob), most likely first; as many as the request asked for.
    top: tuple[tuple[int, float], ...] = ()
