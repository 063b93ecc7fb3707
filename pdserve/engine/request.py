"""A request inside one engine: its tokens, progress and life cycle.

The engine is token-centric (as vLLM v1): `num_computed_tokens` catches up with `num_tokens`.
A step that brings it level samples one token. Prefill, chunked prefill, a prefix-cache hit,
recompute after preemption and remote KV that arrived from another engine are all the same
mechanism: they differ only in how `num_computed_tokens` advances.

Life cycle:

    WAITING ──schedule──► RUNNING ──stop/length──► FINISHED_*
       ▲                     │
       └─────preempt─────────┘            (blocks freed; recompute later)
    WAITING_FOR_REMOTE_KV ──KV verified──► RUNNING
    any ──abort──► FINISHED_ABORTED
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TypedDict

from pdserve.engine.grammar import GrammarState
from pdserve.protocol.logprobs import TokenLogprobs
from pdserve.protocol.sampling import SamplingParams


class StartOptions(TypedDict, total=False):
    """How a request starts, beyond its prompt and sampling (both default off)."""

    # Its blocks outlive it until `Engine.release` (a prefill result awaiting its transfer).
    hold_kv: bool
    # Tokens another engine already produced (a migration): recomputed like the prompt, and
    # sampling continues at the next token index.
    output_token_ids: list[int] | None


class RequestStatus(enum.Enum):
    """Where a request is in its engine life cycle."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    # Its own sampling or stop check raised: it alone ends, the batch goes on.
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason, None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)
class Request:
    """One generation request as the engine sees it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # The seed actually used (from sampling_params or drawn by the engine).
    seed: int
    # Token ids that end generation (the sampling params' plus EOS unless ignore_eos).
    stop_token_ids: frozenset[int]
    arrival_ns: int
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose KV is in this engine's cache.
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at the last admission.
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Keep the KV blocks after finishing until `release` (a prefill result awaiting transfer).
    hold_kv: bool = False
    first_token_ns: int | None = None
    finish_ns: int | None = None
    # Structured output: the grammar's position after the output tokens so far.
    grammar: GrammarState | None = None
    # Logprobs of prompt tokens 1.. (when asked), filled as prefill chunks run; position 0 has
    # none. Only a request prefilled here from its first token collects them.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    collects_prompt_logprobs: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while prompt positions still lack their logprobs (cached KV has no logits,
        so such a request bypasses the prefix cache)."""
        return (
            self.collects_prompt_logprobs and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    def token_at(self, index: int) -> int:
        """Token id at absolute position `index` (prompt first, then outputs)."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]
