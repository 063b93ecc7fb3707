"""KV events: the log's numbering and gaps, and a block manager whose events, applied in order,
rebuild exactly its prefix cache (exact hashes, and under random use)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.block_manager import BlockManager, prefix_block_hashes
from pdserve.engine.kv_events import KVEvent, KVEventKind, KVEventLog


def replay(events: list[KVEvent]) -> set[int]:
    held: set[int] = set()
    for e in events:
        if e.kind is KVEventKind.STORED:
            held |= set(e.block_hashes)
        elif e.kind is KVEventKind.EVICTED:
            held -= set(e.block_hashes)
        else:
            held.clear()
    return held


def test_events_are_numbered_from_one_and_empty_changes_are_not_events() -> None:
    woken: list[int] = []
    log = KVEventLog(capacity=3, on_append=lambda: woken.append(1))
    assert (log.last_seq, log.since(0)) == (0, [])
    log.append(KVEventKind.STORED, [])
    log.append(KVEventKind.STORED, [11, 12])
    log.append(KVEventKind.EVICTED, [11])
    log.append(KVEventKind.CLEARED)
    assert log.last_seq == 3 and len(woken) == 3
    assert log.since(1) == [
        KVEvent(2, KVEventKind.EVICTED, (11,)),
        KVEvent(3, KVEventKind.CLEARED, ()),
    ]
    assert log.since(3) == [] and log.since(7) == []


def test_a_dropped_event_is_a_gap() -> None:
    log = KVEventLog(capacity=2)
    for h in (1, 2, 3):
        log.append(KVEventKind.STORED, [h])
    assert log.since(0) is None  # event 1 was dropped
    assert [e.seq for e in log.since(1) or []] == [2, 3]
    assert KVEventLog().epoch != log.epoch


def test_block_manager_publishes_stored_evicted_and_cleared_hashes() -> None:
    log = KVEventLog()
    bm = BlockManager(num_blocks=4, block_size=2, events=log)
    a = [1, 2, 3, 4, 5]
    assert bm.allocate_slots("a", 5)
    bm.cache_blocks("a", a, 5)
    ha = prefix_block_hashes(a, 2)
    assert log.since(0) == [KVEvent(1, KVEventKind.STORED, tuple(ha))]
    bm.cache_blocks("a", a, 5)  # nothing new: no event
    assert log.last_seq == 1
    bm.free("a")
    # Free queue [2, 3, 1, 0]: the uncached blocks, then a's cached tail first.
    assert bm.allocate_slots("b", 6)
    assert log.since(1) == [KVEvent(2, KVEventKind.EVICTED, (ha[1],))]
    assert bm.allocate_slots("b", 8)
    assert log.since(2) == [KVEvent(3, KVEventKind.EVICTED, (ha[0],))]
    bm.free("b")
    bm.reset_prefix_cache()
    assert log.since(3) == [KVEvent(4, KVEventKind.CLEARED, ())]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["add", "free", "reset"]), st.integers(0, 5), st.integers(1, 9)),
        max_size=40,
    )
)
def test_replaying_the_events_rebuilds_the_cache(ops: list[tuple[str, int, int]]) -> None:
    log = KVEventLog(capacity=10_000)
    bm = BlockManager(num_blocks=12, block_size=2, events=log)
    live: set[str] = set()
    for n, (op, prompt, length) in enumerate(ops):
        rid = f"r{n}"
        if op == "add":
            # Prompts share prefixes (one of six streams), so hits and evictions both happen.
            tokens = [prompt * 100 + i for i in range(length)]
            blocks, _ = bm.get_computed_blocks(tokens)
            if bm.allocate_slots(rid, length, blocks):
                bm.cache_blocks(rid, tokens, length)
                live.add(rid)
        elif op == "free" and live:
            victim = sorted(live)[prompt % len(live)]
            bm.free(victim)
            live.discard(victim)
        elif op == "reset":
            bm.reset_prefix_cache()
        assert replay(log.since(0) or []) == set(bm.cached)
        bm.check_invariants()
