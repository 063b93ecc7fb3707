"""What a flow is: the shared types of the disaggregated and colocated request paths.

A flow takes a tokenized request with its timeline and yields the worker's tokens as
`TokenChunk`s. It owns worker selection, reservations and cleanup for that request; it knows
nothing about text, stop strings or HTTP to the client (that is `openai_api`). A consumer may
close the stream at any point (client gone, stop string found): the flow then releases whatever
the workers still hold for the request. A consumer that ends the request itself (a stop string)
moves the timeline to FINISHED before closing, so the flow records no failure.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

from pdserve.protocol.request_state import RequestTimeline
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker_api import (
    LogprobModel,
    PrefillResult,
    StepInfo,
    TokenEvent,
)


@dataclass(slots=True)
class FlowRequest:
    """One request as the flows see it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # Mutable: the flow advances it.
    timeline: RequestTimeline
    # The conversation it continues (OpenAI `user` or `x-session-id`): affinity routing
    # prefers the worker that served the session's last turn.
    session_id: str | None = None
    # When the whole request must have ended, in event-loop time (`loop.time()`): every call
    # to a worker is bounded by it and tells the worker how long it still has.
    deadline: float = math.inf

    def remaining_s(self) -> float | None:
        """Seconds left before the deadline (at least a millisecond); None without one."""
        if math.isinf(self.deadline):
            return None
        return max(self.deadline - asyncio.get_running_loop().time(), 0.001)


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """Tokens from a worker, in order; `finish_reason` set on the last chunk only."""

    token_ids: list[int]
    finish_reason: str | None = None
    # One per token when the sampling asked for logprobs (a flow passes the worker's on).
    logprobs: list[LogprobModel] | None = None
    # Prompt tokens 1.. with the first chunk, when the sampling asked for prompt logprobs.
    prompt_logprobs: list[LogprobModel] | None = None
    # Prompt tokens the worker's prefix cache supplied (first chunk with tokens).
    num_cached_tokens: int | None = None
    # The worker's engine step that produced these tokens, when a worker stream did (not the
    # prefill's first token): whether prefill shared the batch (interference metrics).
    step: StepInfo | None = None

    @classmethod
    def of_event(cls, event: TokenEvent, finish_reason: str | None = None) -> TokenChunk:
        """A worker's stream line as a chunk (`finish_reason` set on the last)."""
        return cls(
            event.token_ids,
            finish_reason,
            event.logprobs,
            event.prompt_logprobs,
            event.num_cached_tokens,
            event.step,
        )

    @classmethod
    def of_prefill(cls, result: PrefillResult, finish_reason: str | None = None) -> TokenChunk:
        """The prefill worker's first token as a chunk."""
        logprobs = None if result.first_logprobs is None else [result.first_logprobs]
        return cls(
            [result.first_token_id],
            finish_reason,
            logprobs,
            result.prompt_logprobs,
            result.num_cached_tokens,
        )


class Flow(Protocol):
    """A request path: disaggregated or colocated."""

    def stream(self, request: FlowRequest) -> AsyncGenerator[TokenChunk, None]:
        """The request's tokens; raises NoCapacity, WorkerCallError or WorkerUnreachable."""
        ...
