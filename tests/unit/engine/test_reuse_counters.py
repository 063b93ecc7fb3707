"""The scheduler's reuse totals (worker /metrics): prefill work done, cache hits, KV arrived."""

from __future__ import annotations

from pdserve.config import EngineConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.protocol.sampling import SamplingParams

BS = 4


def make(rid: str, tokens: list[int], max_tokens: int = 3) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(rid, list(tokens), params, 0, frozenset(), 0)


def run_to_end(s: Scheduler) -> None:
    while s.running or s.waiting:
        out = s.schedule()
        s.update_after_step(out)
        for item in out.scheduled:
            if item.samples:
                r = item.request
                r.output_token_ids.append(500 + r.num_output_tokens)
                if r.num_output_tokens >= r.sampling_params.max_tokens:
                    s.finish(r, RequestStatus.FINISHED_LENGTH)


def test_a_second_turn_counts_only_its_uncached_suffix() -> None:
    cfg = EngineConfig(block_size=BS, num_blocks=32)
    s = Scheduler(cfg, BlockManager(32, BS))
    first = make("t1", list(range(10)))
    s.add(first)
    run_to_end(s)
    assert (s.num_prefill_tokens_total, s.num_prefill_cached_tokens_total) == (10, 0)
    # Turn 2: prompt + the 3 outputs + 5 new tokens. Computed before: 10 prompt + 2 outputs
    # (the last output was never fed) = 12 tokens = 3 whole blocks.
    second = make("t2", [*first.prompt_token_ids, *first.output_token_ids, *range(90, 95)])
    s.add(second)
    run_to_end(s)
    assert s.num_prefill_cached_tokens_total == 12
    assert s.num_prefill_tokens_total == 10 + (18 - 12)
    assert s.num_remote_kv_blocks_total == s.num_remote_cached_tokens_total == 0


def test_remote_kv_counts_the_blocks_after_the_cached_prefix() -> None:
    cfg = EngineConfig(block_size=BS, num_blocks=32)
    s = Scheduler(cfg, BlockManager(32, BS))
    local = make("local", list(range(9)), max_tokens=1)
    s.add(local)
    run_to_end(s)  # caches blocks [0..3], [4..7]
    remote = make("remote", [*range(9), *range(40, 50)])  # 19 tokens: 5 blocks, 2 cached
    assert s.add_remote(remote) == 8
    s.mark_remote_kv_ready("remote", first_token_id=7)
    assert s.num_remote_kv_blocks_total == 5 - 2
    assert s.num_remote_cached_tokens_total == 8
    # Nothing was prefilled for the remote request.
    assert s.num_prefill_tokens_total == 9
