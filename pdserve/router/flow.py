"""What a flow is: the shared types of the disaggregated and colocated request paths.

A flow takes a tokenized request with its timeline and yields the worker's tokens as
`TokenChunk`s. It owns worker selection, reservations and cleanup for that request; it knows
nothing about text, stop strings or HTTP to the client (that is `openai_api`). A consumer may
close the stream at any point (client gone, stop string found): the flow then releases whatever
the workers still hold for the request. A consumer that ends the request itself (a stop string)
moves the timeline to FINISHED before closing, so the flow records no failure.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Protocol

from pdserve.router.state import RequestTimeline
from pdserve.worker.protocol import SamplingModel, StepInfo


@dataclass(slots=True)
class FlowRequest:
    """One request as the flows see it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingModel
    # Mutable: the flow advances it.
    timeline: RequestTimeline
    # The conversation it continues (OpenAI `user` or `x-session-id`): affinity routing
    # prefers the worker that served the session's last turn.
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """Tokens from a worker, in order; `finish_reason` set on the last chunk only."""

    token_ids: list[int]
    finish_reason: str | None = None
    # The worker's engine step that produced these tokens, when a worker stream did (not the
    # prefill's first token): whether prefill shared the batch (interference metrics).
    step: StepInfo | None = None


class Flow(Protocol):
    """A request path: disaggregated or colocated."""

    def stream(self, request: FlowRequest) -> AsyncGenerator[TokenChunk, None]:
        """The request's tokens; raises NoCapacity, WorkerCallError or WorkerUnreachable."""
        ...
