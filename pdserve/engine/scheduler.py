"""Continuous batching with a per-step token budget, chunked prefill and recompute preemption.

Each step the scheduler hands out at most `max_num_batched_tokens` tokens:
1. running requests first, in admission order: a decode request takes one token, a request in
   the middle of its prompt takes the next chunk that fits the remaining budget;
2. then waiting requests FCFS, each starting from its longest cached prefix, as long as blocks,
   budget and `max_num_seqs` allow. Waiting requests are not admitted in a step that had to
   preempt (the pool is already short).
When a running request needs a block and none is free, the most recently admitted running
request is preempted: its blocks are freed and it returns to the head of the waiting queue to be
recomputed later. Sampling is keyed by token index, so recompute yields the same tokens.

Remote KV (disaggregation): `add_remote` allocates blocks for a request whose prompt KV will be
written by the transfer layer; the request is never scheduled until `mark_remote_kv_ready`
(after checksums and fingerprint have been verified), which makes it a running decode request.

This module knows requests and block ids only: no tensors, no sockets, no clocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.config import EngineConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.errors import DuplicateRequest, KVNotReady, PromptTooLong, RequestNotFound


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    # Tokens to compute this step, starting at request.num_computed_tokens.
    num_new_tokens: int
    # True when this step brings the request level and so samples a token.
    samples: bool


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests preempted this step (their KV is gone; they will be recomputed).
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Decides which tokens of which requests each step computes."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests whose prompt KV is arriving from another engine.
        self.remote: dict[str, Request] = {}
        # Finished requests whose blocks are held for another party until `release`.
        self.held: dict[str, Request] = {}
        self._requests: dict[str, Request] = {}
        # Totals since start, for metrics (what prefix reuse saved is measured, not guessed):
        # prompt (and resumed output) tokens admitted for local compute and those found in
        # the prefix cache instead; for remote-KV requests, blocks that arrived verified and
        # prompt tokens found cached here (never transferred).
        self.num_prefill_tokens_total = 0
        self.num_prefill_cached_tokens_total = 0
        self.num_remote_kv_blocks_total = 0
        self.num_remote_cached_tokens_total = 0

    # ---- admission ---------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request for local prefill."""
        self._register(request)
        self.waiting.append(request)

    def add_remote(self, request: Request) -> int:
        """Allocate blocks for a request whose prompt KV will arrive from elsewhere.

        Returns the number of leading prompt tokens already present in the local prefix cache;
        only the KV after them needs to travel. Raises PromptTooLong when blocks are short.
        """
        self._check_fits(request)
        bm = self.block_manager
        computed, num_cached = bm.get_computed_blocks(request.prompt_token_ids)
        # One slot beyond the prompt: the first decode step writes the first token's KV, so
        # that step never waits for a block (reserve before release).
        if not bm.allocate_slots(request.request_id, request.num_prompt_tokens + 1, computed):
            raise PromptTooLong(
                f"request {request.request_id}: "
                f"{bm.num_blocks_needed(request.num_prompt_tokens + 1)}"
                f" blocks needed for remote KV, {bm.num_free_blocks} free"
            )
        self._register(request)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.num_cached_tokens = num_cached
        self.remote[request.request_id] = request
        return num_cached

    def mark_remote_kv_ready(self, request_id: str, first_token_id: int) -> None:
        """The request's prompt KV is verified; with the first token sampled by the prefill
        engine it becomes a running decode request."""
        request = self.remote.pop(request_id, None)
        if request is None:
            raise KVNotReady(f"request {request_id}: no remote KV allocation to mark ready")
        request.output_token_ids.append(first_token_id)
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        bm = self.block_manager
        num_cached_blocks = request.num_cached_tokens // bm.block_size
        self.num_remote_kv_blocks_total += (
            bm.num_blocks_needed(request.num_prompt_tokens) - num_cached_blocks
        )
        self.num_remote_cached_tokens_total += request.num_cached_tokens
        self.block_manager.cache_blocks(
            request_id, request.all_token_ids, request.num_computed_tokens
        )
        self.running.append(request)

    def _register(self, request: Request) -> None:
        if request.request_id in self._requests or request.request_id in self.held:
            raise DuplicateRequest(f"request {request.request_id} is already in the engine")
        self._check_fits(request)
        self._requests[request.request_id] = request

    def _check_fits(self, request: Request) -> None:
        need = self.block_manager.num_blocks_needed(
            request.num_prompt_tokens + request.sampling_params.max_tokens
        )
        if need > self.block_manager.num_blocks:
            raise PromptTooLong(
                f"request {request.request_id}: {request.num_prompt_tokens} prompt tokens + "
                f"max_tokens {request.sampling_params.max_tokens} need {need} KV blocks, "
                f"the cache has {self.block_manager.num_blocks}"
            )
        if (
            not self.config.enable_chunked_prefill
            and request.num_tokens > self.config.max_num_batched_tokens
        ):
            raise PromptTooLong(
                f"request {request.request_id}: {request.num_tokens} tokens exceed "
                f"max_num_batched_tokens {self.config.max_num_batched_tokens} "
                "with chunked prefill off"
            )

    # ---- stepping --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens; allocates the blocks they need."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0:
                i += 1
                continue
            while not bm.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                i += 1
        if out.preempted_ids:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            computed: list[int] = []
            num_cached = 0
            if request.num_computed_tokens == 0 and not request.needs_prompt_logprobs:
                computed, num_cached = bm.get_computed_blocks(request.all_token_ids)
            num_new = self._chunk(request.num_tokens - num_cached, budget)
            if num_new == 0:
                break
            if not bm.allocate_slots(request.request_id, num_cached + num_new, computed):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            request.num_cached_tokens = num_cached
            self.num_prefill_tokens_total += request.num_tokens - num_cached
            self.num_prefill_cached_tokens_total += num_cached
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        return out

    def _chunk(self, num_remaining: int, budget: int) -> int:
        if num_remaining <= budget:
            return num_remaining
        return budget if self.config.enable_chunked_prefill else 0

    @staticmethod
    def _scheduled(request: Request, num_new: int) -> ScheduledRequest:
        samples = request.num_computed_tokens + num_new == request.num_tokens
        return ScheduledRequest(request, num_new, samples)

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance computed-token counts and publish newly full blocks to the prefix cache."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_blocks(
                s.request.request_id, s.request.all_token_ids, s.request.num_computed_tokens
            )

    # ---- finishing -------------------------------------------------------------------------

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues; its blocks are freed unless it holds its KV."""
        request.status = status
        rid = request.request_id
        self._requests.pop(rid, None)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.remote.pop(rid, None)
        if request.hold_kv and status not in (
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
        ):
            self.held[rid] = request
        else:
            self.block_manager.free(rid)

    def abort(self, request_id: str) -> Request:
        """Stop a request wherever it is and free its blocks (held KV included)."""
        request = self._requests.get(request_id) or self.held.pop(request_id, None)
        if request is None:
            raise RequestNotFound(f"request {request_id} is not in the engine")
        request.hold_kv = False
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def release(self, request_id: str) -> int:
        """Free the blocks of a finished request that held its KV; returns blocks freed."""
        request = self.held.pop(request_id, None)
        if request is None:
            raise RequestNotFound(f"request {request_id} holds no KV")
        return self.block_manager.free(request_id)

    def get(self, request_id: str) -> Request:
        """A live or held request by id."""
        request = self._requests.get(request_id) or self.held.get(request_id)
        if request is None:
            raise RequestNotFound(f"request {request_id} is not in the engine")
        return request

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.remote)

    @property
    def num_held_blocks(self) -> int:
        """Blocks pinned for another party: held prefill results and remote-KV allocations."""
        bm = self.block_manager
        return sum(len(bm.block_ids(r)) for r in (*self.held, *self.remote))
