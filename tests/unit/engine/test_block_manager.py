"""Block manager: exact block ids, sharing, eviction order, and invariants under random use."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.block_manager import BlockManager, prefix_block_hashes


def test_allocation_takes_blocks_from_the_head_in_order() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate_slots("a", 9)  # 3 blocks
    assert bm.block_ids("a") == [0, 1, 2]
    assert bm.allocate_slots("b", 4)
    assert bm.block_ids("b") == [3]
    assert bm.allocate_slots("a", 13)  # grows by one
    assert bm.block_ids("a") == [0, 1, 2, 4]
    assert bm.num_free_blocks == 3
    bm.check_invariants()


def test_allocation_refused_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate_slots("a", 12)
    before = bm.free_queue()
    assert not bm.allocate_slots("b", 8)
    assert bm.block_ids("b") == []
    assert bm.free_queue() == before
    bm.check_invariants()


def test_free_queues_uncached_blocks_first_and_cached_tail_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    assert bm.allocate_slots("a", 5)  # blocks 0, 1, 2; 2 is partial
    bm.cache_blocks("a", tokens, 5)  # blocks 0 and 1 are full and cached
    assert bm.num_cached_blocks == 2
    bm.free("a")
    # free queue before: [3, 4, 5]; uncached block 2 goes to the head, cached 1 then 0 to the tail
    assert bm.free_queue() == [2, 3, 4, 5, 1, 0]
    bm.check_invariants()


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    tokens = [7, 8, 9, 10, 11, 12]
    assert bm.allocate_slots("a", 6)
    bm.cache_blocks("a", tokens, 6)
    # Exactly the same prompt: the last block is not reused, one token must be computed.
    blocks, num_cached = bm.get_computed_blocks(tokens)
    assert (blocks, num_cached) == ([0, 1], 4)
    assert bm.allocate_slots("b", 6, blocks)
    assert bm.block_ids("b") == [0, 1, 3]
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    bm.check_invariants()


def test_cached_block_revived_from_the_free_queue() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    assert bm.allocate_slots("a", 5)
    bm.cache_blocks("a", tokens, 5)
    bm.free("a")
    blocks, n = bm.get_computed_blocks(tokens)
    assert (blocks, n) == ([0, 1], 4)
    assert bm.allocate_slots("b", 5, blocks)
    assert bm.block_ids("b") == [0, 1, 2]
    assert bm.free_queue() == [3]
    bm.check_invariants()


def test_lru_eviction_order_of_cached_prefixes() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = [1, 2, 3], [5, 6, 7]
    assert bm.allocate_slots("old", 3)
    bm.cache_blocks("old", old, 3)
    bm.free("old")  # queue [1, 2, 3, 0]: uncached 1 ahead, cached 0 at the tail
    assert bm.free_queue() == [1, 2, 3, 0]
    assert bm.allocate_slots("new", 3)  # takes 1, 2
    bm.cache_blocks("new", new, 3)
    bm.free("new")  # queue [2, 3, 0, 1]
    assert bm.free_queue() == [2, 3, 0, 1]
    # Three blocks needed: 2, 3 and then 0, which evicts the older prefix; the newer survives.
    assert bm.allocate_slots("c", 6)
    assert bm.block_ids("c") == [2, 3, 0]
    assert bm.get_computed_blocks(old) == ([], 0)
    assert bm.get_computed_blocks(new) == ([1], 2)
    bm.check_invariants()


def test_hashes_are_chained_prefixes() -> None:
    a = prefix_block_hashes([1, 2, 3, 4], 2)
    b = prefix_block_hashes([9, 9, 3, 4], 2)
    assert len(a) == 2
    assert a[1] != b[1]  # same second block, different history
    assert prefix_block_hashes([1, 2, 3], 2) == a[:1]


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    assert bm.allocate_slots("a", 4)
    bm.cache_blocks("a", [1, 2, 3, 4], 4)
    assert bm.get_computed_blocks([1, 2, 3, 4, 5]) == ([], 0)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["alloc", "free", "cache"]),
            st.integers(0, 4),
            st.integers(1, 20),
            st.integers(0, 2),
        ),
        max_size=60,
    )
)
def test_random_operations_keep_invariants_and_return_every_block(
    ops: list[tuple[str, int, int, int]],
) -> None:
    bm = BlockManager(num_blocks=12, block_size=4)
    tokens: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for op, who, n, flavour in ops:
        rid = f"r{who}"
        if op == "alloc":
            if rid not in tokens:
                # Few distinct prompts so prefixes really are shared.
                tokens[rid] = [flavour] * 8 + list(range(n))
                blocks, _cached = bm.get_computed_blocks(tokens[rid])
                if bm.allocate_slots(rid, len(tokens[rid]), blocks):
                    sizes[rid] = len(tokens[rid])
                else:
                    del tokens[rid]
            else:
                tokens[rid] = tokens[rid] + [flavour] * n
                if bm.allocate_slots(rid, len(tokens[rid])):
                    sizes[rid] = len(tokens[rid])
                else:
                    tokens[rid] = tokens[rid][: sizes[rid]]
        elif op == "cache" and rid in tokens:
            bm.cache_blocks(rid, tokens[rid], sizes[rid])
        elif op == "free" and rid in tokens:
            bm.free(rid)
            del tokens[rid], sizes[rid]
        bm.check_invariants()
    for rid in list(tokens):
        bm.free(rid)
    bm.check_invariants()
    assert bm.num_free_blocks == 12
