"""One inference engine: scheduler + model runner over one paged KV cache.

`step()` is the whole loop: schedule → run → postprocess (append tokens, check stops, finish).
The engine is synchronous and single-threaded; a worker drives it from its own thread.

Hooks for disaggregation, used by the worker and transfer layers (never by the scheduler):
- `add_request(..., hold_kv=True)`: a prefill result keeps its KV blocks after finishing until
  `release` (the transfer of those blocks holds a lease on them);
- `add_remote_request`: allocate blocks for a prompt whose KV will arrive from elsewhere; the
  request is not scheduled until `mark_remote_kv_ready`;
- `kv_block_views`: the request's blocks as writable byte views of KV memory, one per block
  (no copy);
- `kv_events` (optional): the prefix cache's stored/evicted hashes, published for routers
  (`engine/kv_events.py`); `cached_block_hashes` is the snapshot a subscriber starts from.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from pdserve.clock import Clock, MonotonicClock
from pdserve.config import EngineConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.kv_events import KVEventLog
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.errors import ConfigError, PromptTooLong
from pdserve.model.loader import LoadedModel, load_model


@dataclass(frozen=True, slots=True)
class RequestDelta:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    # "stop", "length" or "abort" once finished.
    finish_reason: str | None


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
            num_blocks, mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim, model.dtype
        )
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching, kv_events
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = ModelRunner(model.module, self.kv_cache)
        self._eos = frozenset(model.eos_token_ids)

    @classmethod
    def from_config(
        cls, config: EngineConfig, clock: Clock | None = None, kv_events: KVEventLog | None = None
    ) -> Engine:
        """Load the configured model (the embedded default when no path) and build an engine."""
        m = config.model
        model = load_model(
            m.path, dtype=m.dtype, quantization=m.quantization, kv_block_size=config.block_size
        )
        return cls(model, config, clock, kv_events)

    # ---- requests --------------------------------------------------------------------------

    def _new_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Request:
        if not prompt_token_ids:
            raise PromptTooLong(f"request {request_id}: the prompt is empty")
        limit = self.model.config.max_position_embeddings
        if len(prompt_token_ids) + params.max_tokens > limit:
            raise PromptTooLong(
                f"request {request_id}: {len(prompt_token_ids)} prompt tokens + max_tokens "
                f"{params.max_tokens} exceed the model's context of {limit} tokens"
            )
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"request {request_id}: token ids {bad[:5]} outside 0..{vocab - 1}")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos)
        return Request(request_id, list(prompt_token_ids), params, seed, stops, self.clock.now_ns())

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        hold_kv: bool = False,
        output_token_ids: list[int] | None = None,
    ) -> Request:
        """Queue a request; with `hold_kv` its blocks outlive it until `release`.

        `output_token_ids` resumes a request that another engine had started (migration):
        they are recomputed like the prompt, and sampling continues at the next token index,
        so greedy and seeded output equal an uninterrupted run.
        """
        request = self._new_request(request_id, prompt_token_ids, params)
        if output_token_ids:
            vocab = self.model.config.vocab_size
            bad = [t for t in output_token_ids if not 0 <= t < vocab]
            if bad or len(output_token_ids) >= params.max_tokens:
                raise ConfigError(
                    f"request {request_id}: cannot resume after {len(output_token_ids)} tokens "
                    f"(max_tokens {params.max_tokens}, out-of-range ids {bad[:5]})"
                )
            request.output_token_ids.extend(output_token_ids)
        request.hold_kv = hold_kv
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
        """The request's KV blocks as writable byte views, one per block (no copy)."""
        return self.kv_cache.block_views(self.block_manager.block_ids(request_id))

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
        self.scheduler.mark_remote_kv_ready(request_id, first_token_id)
        self.get_request(request_id).first_token_ns = self.clock.now_ns()

    def abort(self, request_id: str) -> None:
        """Stop the request and free every block it holds."""
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
        """Run one scheduled step; returns the new tokens of every request that got one."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        tables = {
            s.request.request_id: self.block_manager.block_ids(s.request.request_id)
            for s in out.scheduled
        }
        sampled = self.runner.run(out, tables)
        self.scheduler.update_after_step(out)
        now = self.clock.now_ns()
        deltas: list[RequestDelta] = []
        for s in out.scheduled:
            request = s.request
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.output_token_ids.append(token)
            if request.first_token_ns is None:
                request.first_token_ns = now
            status = self._check_stop(request, token)
            if status is not None:
                request.finish_ns = now
                self.scheduler.finish(request, status)
            deltas.append(
                RequestDelta(
                    request.request_id,
                    (token,),
                    status is not None,
                    status.finish_reason if status else None,
                )
            )
        return deltas

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if token in request.stop_token_ids:
            self._set_text(request)
            return RequestStatus.FINISHED_STOPPED
        if params.stop:
            text = self.model.tokenizer.decode(request.output_token_ids)
            hits = [i for i in (text.find(s) for s in params.stop) if i >= 0]
            if hits:
                request.output_text = text[: min(hits)]
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            self._set_text(request)
            return RequestStatus.FINISHED_LENGTH
        return None

    def _set_text(self, request: Request) -> None:
        request.output_text = self.model.tokenizer.decode(request.output_token_ids)

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
        )
