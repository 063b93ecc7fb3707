"""One inference engine: scheduler + model runner over one paged KV cache.

`step()` is the whole loop: schedule → run → postprocess (append tokens, check stops, finish).
The engine is synchronous and single-threaded; a worker drives it from its own thread.

Hooks for disaggregation, used by the worker and transfer layers (never by the scheduler):
- `add_request(..., hold_kv=True)`: a prefill result keeps its KV blocks after finishing until
  `release` (the transfer of those blocks holds a lease on them);
- `add_remote_request`: allocate blocks for a prompt whose KV will arrive from elsewhere; the
  request is not scheduled until `mark_remote_kv_ready`;
- `kv_block_views`: the request's blocks as writable byte views of KV memory, one per block
  (no copy; a cache on a GPU hands out views of its host mirror, `engine/kv_staging.py`);
- `kv_events` (optional): the prefix cache's stored/evicted hashes, published for routers
  (`engine/kv_events.py`); `cached_block_hashes` is the snapshot a subscriber starts from.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from typing import Unpack

import torch

from pdserve.clock import Clock, MonotonicClock
from pdserve.config import EngineConfig
from pdserve.engine.block_manager import BlockManager, prefix_block_hashes
from pdserve.engine.decode_graphs import capture_decode_graphs
from pdserve.engine.grammar import GrammarCompiler
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.kv_events import KVEventLog
from pdserve.engine.kv_staging import KVStaging
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import EngineStats, RequestDelta
from pdserve.engine.request import Request, RequestStatus, StartOptions
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.step_stats import StepFacts, StepTotals, count_tokens, is_decode_slice
from pdserve.errors import ConfigError, PromptTooLong, RequestNotFound, SamplingParamsError
from pdserve.model.device import device_memory
from pdserve.model.loader import LoadedModel, load_model
from pdserve.protocol.logprobs import TokenLogprobs
from pdserve.protocol.sampling import SamplingParams

logger = logging.getLogger(__name__)


class Engine:
    """Continuous-batching inference over a paged KV cache."""

    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig,
        clock: Clock | None = None,
        kv_events: KVEventLog | None = None,
    ) -> None:
        if model.fingerprint.kv_block_size != config.block_size:
            raise ConfigError(
                f"block_size: engine uses {config.block_size}, the model was loaded for "
                f"{model.fingerprint.kv_block_size}"
            )
        if config.batch_invariant and model.device.type != "cpu":
            raise ConfigError(f"batch_invariant: runs on the CPU only, not on {model.device}")
        self.model = model
        self.config = config
        self.clock = clock or MonotonicClock()
        mc = model.config
        num_blocks = config.num_blocks or max(
            1,
            config.kv_cache_bytes
            // KVCache.bytes_per_block(
                mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim, model.dtype
            ),
        )
        self.kv_cache = KVCache(
            num_blocks,
            mc.num_layers,
            config.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            model.dtype,
            shared=config.shared_kv,
            device=model.device,
            staged=config.kv_host_staging,
        )
        self.staging = KVStaging(self.kv_cache)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching, kv_events
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self._eos = frozenset(model.eos_token_ids)
        limit = model.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ConfigError(
                f"max_model_len: {config.max_model_len} exceeds the model's "
                f"max_position_embeddings {limit}"
            )
        self.max_model_len = config.max_model_len or limit
        graphs = capture_decode_graphs(model.module, self.kv_cache, config, self.max_model_len)
        self.runner = ModelRunner(model.module, self.kv_cache, config.batch_invariant, graphs)
        # Structured output; the grammar library is loaded on the first request that asks.
        self.grammars = GrammarCompiler(
            model.tokenizer.to_json, model.config.vocab_size, model.eos_token_ids
        )
        self.step_totals = StepTotals()

    @classmethod
    def from_config(
        cls, config: EngineConfig, clock: Clock | None = None, kv_events: KVEventLog | None = None
    ) -> Engine:
        """Load the configured model (the embedded default when no path) and build an engine."""
        m = config.model
        model = load_model(
            m.path,
            dtype=m.dtype,
            quantization=m.quantization,
            kv_block_size=config.block_size,
            device=m.device,
        )
        return cls(model, config, clock, kv_events)

    # ---- requests --------------------------------------------------------------------------

    def _new_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Request:
        if not prompt_token_ids:
            raise PromptTooLong(f"request {request_id}: the prompt is empty")
        limit = self.max_model_len
        if len(prompt_token_ids) + params.max_tokens > limit:
            raise PromptTooLong(
                f"request {request_id}: {len(prompt_token_ids)} prompt tokens + max_tokens "
                f"{params.max_tokens} exceed the model's context of {limit} tokens"
            )
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"request {request_id}: token ids {bad[:5]} outside 0..{vocab - 1}")
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        bad += [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise SamplingParamsError(
                f"request {request_id}: logit_bias / stop_token_ids token ids {bad[:5]} outside"
                f" 0..{vocab - 1}"
            )
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos)
        request = Request(
            request_id, list(prompt_token_ids), params, seed, stops, self.clock.now_ns()
        )
        if params.grammar is not None:
            request.grammar = self.grammars.state(params.grammar)
        return request

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        **start: Unpack[StartOptions],
    ) -> Request:
        """Queue a request; with `hold_kv` its blocks outlive it until `release`.

        `output_token_ids` resumes a request that another engine had started (migration):
        they are recomputed like the prompt, and sampling continues at the next token index,
        so greedy and seeded output equal an uninterrupted run.
        """
        request = self._new_request(request_id, prompt_token_ids, params)
        output_token_ids = start.get("output_token_ids")
        if output_token_ids:
            vocab = self.model.config.vocab_size
            bad = [t for t in output_token_ids if not 0 <= t < vocab]
            if bad or len(output_token_ids) >= params.max_tokens:
                raise ConfigError(
                    f"request {request_id}: cannot resume after {len(output_token_ids)} tokens "
                    f"(max_tokens {params.max_tokens}, out-of-range ids {bad[:5]})"
                )
            request.output_token_ids.extend(output_token_ids)
            if request.grammar is not None:
                # The grammar state is a function of the tokens: replay them.
                for token_id in output_token_ids:
                    request.grammar.accept(token_id)
        # Prompt logprobs go out once, with the first token of the request's first run.
        request.collects_prompt_logprobs = (
            params.prompt_logprobs is not None and not output_token_ids
        )
        request.hold_kv = start.get("hold_kv", False)
        self.scheduler.add(request)
        return request

    def add_remote_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> int:
        """Reserve blocks for a prompt whose KV arrives from elsewhere (before any prefill).

        Returns how many leading prompt tokens are already cached here: their KV need not
        travel. The request is not scheduled until `mark_remote_kv_ready`.
        """
        request = self._new_request(request_id, prompt_token_ids, params)
        return self.scheduler.add_remote(request)

    def kv_block_views(self, request_id: str) -> list[memoryview]:
        """The request's KV blocks as writable byte views, one per block (no copy): to write
        while it waits for remote KV, else to read (`KVStaging` copies a staged cache's)."""
        request = self.get_request(request_id)
        ids = list(self.block_manager.block_ids(request_id))
        if request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            skip = request.num_cached_tokens // self.config.block_size
            return self.staging.write_views(request_id, ids, skip)
        return self.staging.read_views(ids)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table."""
        return list(self.block_manager.block_ids(request_id))

    def cached_block_hashes(self) -> list[int]:
        """Every chained hash the prefix cache holds now (a KV-event subscriber's snapshot)."""
        return list(self.block_manager.cached)

    def mark_remote_kv_ready(self, request_id: str, first_token_id: int) -> None:
        """The remote KV was verified (checksums, commit, fingerprint): schedule the request.

        `first_token_id` is the token the prefill engine sampled; decoding continues after it.
        """
        vocab = self.model.config.vocab_size
        if not 0 <= first_token_id < vocab:
            raise ConfigError(
                f"request {request_id}: first token {first_token_id} outside 0..{vocab - 1}"
            )
        request = self.get_request(request_id)
        if request.grammar is not None:
            request.grammar.accept(first_token_id)
        self.staging.landed(request_id)
        self.scheduler.mark_remote_kv_ready(request_id, first_token_id)
        request.first_token_ns = self.clock.now_ns()

    def first_token_finishes(self, request_id: str, first_token_id: int) -> str | None:
        """The finish reason if a remote request's first token (sampled by the prefill engine)
        already ends it, else None: a stop token past min_tokens, max_tokens 1, or a grammar
        that this token completes."""
        request = self.get_request(request_id)
        params = request.sampling_params
        if first_token_id in request.stop_token_ids and params.min_tokens == 0:
            return "stop"
        if params.max_tokens <= 1:
            return "length"
        if request.grammar is not None and params.grammar is not None:
            probe = self.grammars.state(params.grammar, [first_token_id])
            if probe.finished:
                return "stop"
        return None

    def canary_logits(self, request_id: str) -> tuple[int, torch.Tensor]:
        """(position, logits) of the request's last prompt position, recomputed from its
        cached KV by a one-token forward (the KV canary, `engine/canary.py`)."""
        request = self.get_request(request_id)
        position = request.num_prompt_tokens - 1
        self.staging.landed(request_id)
        table = self.block_manager.block_ids(request_id)
        token = request.prompt_token_ids[position]
        return position, self.runner.position_logits(list(table), token, position)

    # ---- decode checkpoints (`pdserve/checkpoint/`) ---------------------------------------

    def copy_blocks(self, request_id: str, start: int, end: int) -> list[bytes]:
        """Copies of the request's blocks [start, end) (a checkpoint's snapshot)."""
        ids = self.block_manager.block_ids(request_id)[start:end]
        if len(ids) != end - start:
            raise RequestNotFound(f"request {request_id}: blocks {start}..{end} not held")
        return self.copy_block_ids(ids)

    def copy_block_ids(self, block_ids: list[int]) -> list[bytes]:
        """Copies of these blocks' KV (a block held by a request or cached: full blocks never
        change, so a copy taken between steps is consistent)."""
        return [bytes(v) for v in self.staging.read_views(block_ids)]

    def position_logits(self, block_ids: list[int], token_id: int, position: int) -> torch.Tensor:
        """Logits of `token_id` at `position` over the KV of `block_ids` (a checkpoint's
        value canary; the position's own K/V go to the scratch block)."""
        return self.runner.position_logits(block_ids, token_id, position)

    def num_cached_prefix_blocks(self, token_ids: list[int]) -> int:
        """Leading full blocks of `token_ids` whose KV the prefix cache holds (no counters)."""
        return len(self.cached_prefix_block_ids(token_ids))

    def cached_prefix_block_ids(self, token_ids: list[int]) -> list[int]:
        """The cache's blocks holding the leading full blocks of `token_ids` (no counters)."""
        ids: list[int] = []
        for h in prefix_block_hashes(token_ids, self.config.block_size):
            block_id = self.block_manager.cached.get(h)
            if block_id is None:
                break
            ids.append(block_id)
        return ids

    def import_begin(self, import_id: str, num_blocks: int) -> list[memoryview] | None:
        """Fresh blocks for KV pulled from elsewhere, as writable views (None: no room)."""
        bm = self.block_manager
        if not bm.allocate_slots(import_id, num_blocks * self.config.block_size):
            return None
        return self.staging.write_views(import_id, list(bm.block_ids(import_id)))

    def import_landed(self, import_id: str) -> None:
        """The import's bytes are complete and checksummed: make them visible to the model
        (a staged cache copies them to the device; otherwise nothing to do)."""
        self.staging.landed(import_id)

    def import_end(self, import_id: str, token_ids: list[int] | None) -> None:
        """Free the import's blocks; with the `token_ids` they hold (verified), register them
        in the prefix cache first, so the next request with that prefix reuses them."""
        bm = self.block_manager
        if token_ids is not None:
            self.staging.landed(import_id)
            bm.cache_blocks(import_id, token_ids, len(token_ids))
        self.staging.forget(import_id)
        bm.free(import_id)

    def abort(self, request_id: str) -> None:
        """Stop the request and free every block it holds."""
        self.staging.forget(request_id)
        self.scheduler.abort(request_id)

    def release(self, request_id: str) -> int:
        """Free the KV a finished request held for a transfer; returns blocks freed."""
        return self.scheduler.release(request_id)

    def get_request(self, request_id: str) -> Request:
        return self.scheduler.get(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def has_work(self) -> bool:
        """True when a step would compute something (remote-KV waits are not work)."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    # ---- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Run one scheduled step; returns the new tokens of every request that got one.

        Each delta carries the step's facts (`StepFacts`: duration, prefill and decode tokens)
        and whether its request's slice was a decode slice; `step_totals` counts every step.
        """
        start_ns = self.clock.now_ns()
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        # Classified before the step runs: sampling below appends output tokens.
        decode_ids = {
            s.request.request_id
            for s in out.scheduled
            if is_decode_slice(s.num_new_tokens, s.request.num_output_tokens)
        }
        num_prefill, num_decode = count_tokens(
            (s.num_new_tokens, s.request.num_output_tokens) for s in out.scheduled
        )
        tables = {
            s.request.request_id: self.block_manager.block_ids(s.request.request_id)
            for s in out.scheduled
        }
        result = self.runner.run(out, tables)
        self.scheduler.update_after_step(out)
        now = self.clock.now_ns()
        facts = StepFacts(
            self.step_totals.num_steps, (now - start_ns) / 1e9, num_prefill, num_decode
        )
        self.step_totals.observe(facts)
        deltas: list[RequestDelta] = []
        for s in out.scheduled:
            request = s.request
            rid = request.request_id
            if rid in result.prompt_logprobs:
                first, values = result.prompt_logprobs[rid]
                # A recompute after preemption computes positions again: keep the first.
                have = len(request.prompt_logprobs)
                request.prompt_logprobs.extend(values[max(0, have - first) :])
            sampled = result.sampled.get(rid)
            error = result.failed.get(rid)
            if sampled is None and error is None:
                continue
            prompt_logprobs = None
            status: RequestStatus | None = None
            if sampled is not None:
                try:
                    prompt_logprobs, status = self._take_token(request, sampled.token_id, now)
                except Exception as exc:
                    error = exc
            if error is not None:
                # This request alone ends with finish reason "error"; the batch goes on.
                logger.error("request %s failed in its step: %r", rid, error)
                status = RequestStatus.FINISHED_ERROR
            if status is not None:
                request.finish_ns = now
                self.scheduler.finish(request, status)
            # A failed request's token (if one was drawn) is not delivered.
            emitted = sampled if error is None else None
            deltas.append(
                RequestDelta(
                    rid,
                    () if emitted is None else (emitted.token_id,),
                    status is not None,
                    status.finish_reason if status else None,
                    logprobs=()
                    if emitted is None or emitted.logprobs is None
                    else (emitted.logprobs,),
                    prompt_logprobs=prompt_logprobs,
                    num_cached_tokens=request.num_cached_tokens,
                    step=facts,
                    decode=rid in decode_ids,
                )
            )
        return deltas

    def _take_token(
        self, request: Request, token: int, now: int
    ) -> tuple[tuple[TokenLogprobs, ...] | None, RequestStatus | None]:
        """Append a sampled token (grammar advanced, first-token time set); returns the prompt
        logprobs to report with it, if now, and the status it finishes with, if it does."""
        if request.grammar is not None:
            request.grammar.accept(token)
        request.output_token_ids.append(token)
        prompt_logprobs = None
        if request.first_token_ns is None:
            request.first_token_ns = now
            if request.collects_prompt_logprobs:
                prompt_logprobs = tuple(request.prompt_logprobs)
        return prompt_logprobs, self._check_stop(request, token)

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        """Stop token ids and EOS, a finished grammar, max_tokens. Stop strings are not checked
        here: the router (or `pdserve.llm`) applies them incrementally over the text it
        detokenizes anyway, and ends the request, so no engine step decodes an output."""
        params = request.sampling_params
        # Before min_tokens tokens exist nothing but max_tokens ends the request (vLLM).
        past_min = request.num_output_tokens > params.min_tokens
        if past_min and token in request.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and request.grammar.finished:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def stats(self) -> EngineStats:
        """Current block and queue counts."""
        bm = self.block_manager
        sch = self.scheduler
        return EngineStats(
            num_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            num_cached_blocks=bm.num_cached_blocks,
            num_held_blocks=sch.num_held_blocks,
            num_running=len(sch.running),
            num_waiting=len(sch.waiting),
            num_remote_waiting=len(sch.remote),
            prefix_cache_queries_tokens=bm.num_cache_queries_tokens,
            prefix_cache_hit_tokens=bm.num_cache_hit_tokens,
            num_prefill_tokens_total=sch.num_prefill_tokens_total,
            num_prefill_cached_tokens_total=sch.num_prefill_cached_tokens_total,
            num_remote_kv_blocks_total=sch.num_remote_kv_blocks_total,
            num_remote_cached_tokens_total=sch.num_remote_cached_tokens_total,
            kv_block_bytes=self.kv_cache.block_bytes,
            steps=dataclasses.replace(self.step_totals),
            device_memory=device_memory(self.kv_cache.device),
            host_staged_bytes=self.staging.staged_bytes(),
        )
