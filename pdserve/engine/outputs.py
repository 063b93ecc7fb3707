"""What an engine reports: the tokens one step produced for one request (`RequestDelta`), and
its block and queue counts (`EngineStats`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdserve.engine.step_stats import StepFacts, StepTotals
from pdserve.protocol.logprobs import TokenLogprobs


@dataclass(frozen=True, slots=True)
class RequestDelta:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    # "stop", "length" or "abort" once finished.
    finish_reason: str | None
    # One per new token when the request asked for logprobs.
    logprobs: tuple[TokenLogprobs, ...] = ()
    # With the first token of a request that asked for prompt logprobs: prompt tokens 1...
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    # Prompt tokens served from the prefix cache when the request was admitted.
    num_cached_tokens: int = 0
    # The step that produced the token (None for deltas made outside a step: abort, errors).
    step: StepFacts | None = None
    # True when this request's share of that step was a decode slice (one token after an
    # output token), so the token's wait measures decode time per output token.
    decode: bool = False


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Block and queue counts, for health, load balancing and leak checks."""

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    # Blocks held for another party (prefill results awaiting transfer, remote-KV allocations).
    num_held_blocks: int
    num_running: int
    num_waiting: int
    num_remote_waiting: int
    prefix_cache_queries_tokens: int
    prefix_cache_hit_tokens: int
    # Totals since start (see `Scheduler`): tokens admitted for local prefill and those the
    # prefix cache supplied; remote-KV blocks received verified, prompt tokens not sent
    # because they were cached here; and the bytes of one KV block (all layers).
    num_prefill_tokens_total: int = 0
    num_prefill_cached_tokens_total: int = 0
    num_remote_kv_blocks_total: int = 0
    num_remote_cached_tokens_total: int = 0
    kv_block_bytes: int = 0
    # Steps run, per kind, with their seconds and the busy time of each phase.
    steps: StepTotals = field(default_factory=StepTotals)
    # On a GPU, torch's allocator figures for the engine's device ("allocated", "reserved"
    # bytes); empty on the CPU, where there is no allocator of torch's own to read.
    device_memory: Mapping[str, int] = field(default_factory=dict)
    # Bytes of KV copied through the host mirror, by direction ("out": device to mirror, to
    # be sent; "in": received, mirror to device); empty when the cache is not staged.
    host_staged_bytes: Mapping[str, int] = field(default_factory=dict)
