"""Scheduler stepped by hand: budgets, chunking, FCFS, preemption, remote KV, holds; no leaks."""

from __future__ import annotations

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.errors import DuplicateRequest, KVNotReady, PromptTooLong, RequestNotFound
from pdserve.protocol.sampling import SamplingParams


def make(rid: str, n_prompt: int, max_tokens: int = 4, base: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(rid, [base + i for i in range(n_prompt)], params, 0, frozenset(), 0)


def sched(num_blocks: int = 64, block_size: int = 4, **kw: object) -> Scheduler:
    cfg = EngineConfig(block_size=block_size, num_blocks=num_blocks, **kw)  # type: ignore[arg-type]
    return Scheduler(cfg, BlockManager(num_blocks, block_size, cfg.enable_prefix_caching))


def finish_step(s: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after the forward: advance, append a token, finish at max_tokens."""
    s.update_after_step(out)
    for item in out.scheduled:
        if item.samples:
            r = item.request
            r.output_token_ids.append(1000 + r.num_output_tokens)
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                s.finish(r, RequestStatus.FINISHED_LENGTH)


def plan(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(x.request.request_id, x.num_new_tokens, x.samples) for x in out.scheduled]


def assert_no_leak(s: Scheduler) -> None:
    s.block_manager.check_invariants()
    assert s.block_manager.num_free_blocks == s.block_manager.num_blocks


def test_chunked_prefill_mixes_with_decode_under_the_budget() -> None:
    s = sched(max_num_batched_tokens=8)
    s.add(make("a", 3, max_tokens=3))
    s.add(make("b", 20, max_tokens=2, base=100))
    out = s.schedule()
    assert plan(out) == [("a", 3, True), ("b", 5, False)]
    finish_step(s, out)
    out = s.schedule()
    assert plan(out) == [("a", 1, True), ("b", 7, False)]
    finish_step(s, out)
    out = s.schedule()
    assert plan(out) == [("a", 1, True), ("b", 7, False)]
    finish_step(s, out)
    assert s.get("b").num_computed_tokens == 19
    out = s.schedule()
    assert plan(out) == [("b", 1, True)]
    finish_step(s, out)
    out = s.schedule()
    assert plan(out) == [("b", 1, True)]
    finish_step(s, out)
    assert s.num_unfinished == 0
    assert_no_leak(s)


def test_without_chunking_a_prompt_waits_for_a_budget_that_fits_it() -> None:
    s = sched(max_num_batched_tokens=8, enable_chunked_prefill=False)
    s.add(make("a", 6))
    s.add(make("b", 6, base=50))
    out = s.schedule()
    assert plan(out) == [("a", 6, True)]
    with pytest.raises(PromptTooLong, match="max_num_batched_tokens 8"):
        s.add(make("c", 9))


def test_fcfs_and_max_num_seqs() -> None:
    s = sched(max_num_seqs=2)
    for rid in "abc":
        s.add(make(rid, 2))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_preemption_by_recompute_frees_the_newest_and_requeues_it_first() -> None:
    # 4 blocks of 2 tokens: two requests of 3 prompt tokens fill them as they decode.
    s = sched(num_blocks=4, block_size=2, max_num_batched_tokens=16)
    s.add(make("a", 3, max_tokens=4))
    s.add(make("b", 3, max_tokens=4, base=10))
    out = s.schedule()
    assert plan(out) == [("a", 3, True), ("b", 3, True)]
    finish_step(s, out)
    out = s.schedule()  # position 3 still fits each request's second block
    assert plan(out) == [("a", 1, True), ("b", 1, True)]
    finish_step(s, out)
    # Position 4 needs a third block each; the pool has none left, so b (newest) goes.
    out = s.schedule()
    assert out.preempted_ids == ["b"]
    assert plan(out) == [("a", 1, True)]
    b = s.waiting[0]
    assert (b.request_id, b.status, b.num_computed_tokens) == ("b", RequestStatus.WAITING, 0)
    assert b.output_token_ids == [1000, 1001]  # kept: recompute replays prompt + outputs
    a = s.running[0]
    while s.num_unfinished:
        finish_step(s, s.schedule())
    assert a.output_token_ids == b.output_token_ids == [1000, 1001, 1002, 1003]
    assert b.num_preemptions == 1
    assert_no_leak(s)


def test_prefix_cache_hit_skips_cached_tokens() -> None:
    s = sched(block_size=4)
    s.add(make("a", 9, max_tokens=1))
    finish_step(s, s.schedule())
    s.add(make("b", 10, max_tokens=1))  # same first 9 tokens
    out = s.schedule()
    assert plan(out) == [("b", 2, True)]
    assert s.get("b").num_cached_tokens == 8
    finish_step(s, out)
    assert s.block_manager.num_free_blocks == 64


def test_remote_kv_request_is_not_scheduled_until_ready() -> None:
    s = sched(block_size=4)
    r = make("r", 9, max_tokens=3)
    assert s.add_remote(r) == 0
    assert s.block_manager.block_ids("r") == [0, 1, 2]
    assert s.num_held_blocks == 3
    assert s.schedule().scheduled == []
    s.mark_remote_kv_ready("r", 7)  # the first token, sampled by the prefill engine
    out = s.schedule()
    assert plan(out) == [("r", 1, True)]
    with pytest.raises(KVNotReady):
        s.mark_remote_kv_ready("r", 7)
    while s.num_unfinished:
        finish_step(s, s.schedule())
    assert r.output_token_ids == [7, 1001, 1002]
    assert_no_leak(s)


def test_remote_request_reports_locally_cached_prefix() -> None:
    s = sched(block_size=4)
    s.add(make("a", 9, max_tokens=1))
    finish_step(s, s.schedule())
    r = make("r", 12, max_tokens=2)
    assert s.add_remote(r) == 8


def test_hold_kv_keeps_blocks_until_release_and_abort_frees_them() -> None:
    s = sched(block_size=4)
    a = make("a", 5, max_tokens=1)
    a.hold_kv = True
    s.add(a)
    finish_step(s, s.schedule())
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert s.block_manager.block_ids("a") == [0, 1]
    assert s.num_held_blocks == 2
    assert s.release("a") == 2
    with pytest.raises(RequestNotFound):
        s.release("a")
    b = make("b", 5, max_tokens=1)
    b.hold_kv = True
    s.add(b)
    finish_step(s, s.schedule())
    s.abort("b")
    assert_no_leak(s)


def test_abort_in_every_queue_frees_blocks() -> None:
    s = sched(block_size=4, max_num_seqs=1)
    s.add(make("run", 5, max_tokens=8))
    s.add(make("wait", 5, max_tokens=8))
    s.add_remote(make("remote", 5))
    s.schedule()
    for rid in ("run", "wait", "remote"):
        s.abort(rid)
    assert s.num_unfinished == 0
    assert_no_leak(s)


def test_duplicate_and_oversized_requests_are_refused() -> None:
    s = sched(num_blocks=4, block_size=4)
    s.add(make("a", 4))
    with pytest.raises(DuplicateRequest):
        s.add(make("a", 4))
    with pytest.raises(PromptTooLong, match="need 5 KV blocks"):
        s.add(make("big", 17, max_tokens=1))
