"""The router's prefix index: leading matches, LRU order like the engine's, restarts."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdserve.engine.block_manager import BlockManager, prefix_block_hashes
from pdserve.router.placement.prefix_index import PrefixIndex

BS = 4


def test_match_counts_leading_blocks_only() -> None:
    index = PrefixIndex()
    tokens = list(range(16))
    hashes = prefix_block_hashes(tokens, BS)
    index.insert("w", hashes[:3], capacity=10)
    assert index.match("w", hashes) == 3
    assert index.match("w", hashes[:2]) == 2
    # A different first block: the chain differs from the root, nothing matches.
    other = prefix_block_hashes([99, *tokens[1:]], BS)
    assert index.match("w", other) == 0
    assert index.match("unknown", hashes) == 0


def test_insert_orders_eviction_like_the_engine_and_caps_at_capacity() -> None:
    index = PrefixIndex()
    a = prefix_block_hashes(list(range(12)), BS)  # 3 blocks
    b = prefix_block_hashes(list(range(100, 108)), BS)  # 2 blocks
    index.insert("w", a, capacity=4)
    # The last block of a request is evicted first, the first block last.
    assert index.lru_order("w") == [a[2], a[1], a[0]]
    index.insert("w", b, capacity=4)
    # Capacity 4: a's last block (the least recent) goes.
    assert index.lru_order("w") == [a[1], a[0], b[1], b[0]]
    assert index.match("w", a) == 2
    index.insert("w", a[:1], capacity=4)  # a hit refreshes its prefix
    assert index.lru_order("w") == [a[1], b[1], b[0], a[0]]


def test_a_new_incarnation_starts_empty_and_remove_forgets() -> None:
    index = PrefixIndex()
    hashes = prefix_block_hashes(list(range(8)), BS)
    index.observe("w", "decode-0:100")
    index.insert("w", hashes, capacity=10)
    index.observe("w", "decode-0:100")
    assert index.match("w", hashes) == 2
    index.observe("w", "decode-0:200")  # restarted: its cache is empty
    assert index.match("w", hashes) == 0
    index.insert("w", hashes, capacity=10)
    index.remove("w")
    assert index.num_blocks("w") == 0
    index.insert("a", hashes, capacity=10)
    index.insert("b", hashes, capacity=10)
    index.retain({"b"})  # "a" left the pool
    assert (index.num_blocks("a"), index.num_blocks("b")) == (0, 2)


@given(
    prompts=st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=14), min_size=1, max_size=6),
    probe=st.lists(st.integers(0, 3), min_size=1, max_size=14),
)
def test_index_agrees_with_the_block_manager_when_nothing_is_evicted(
    prompts: list[list[int]], probe: list[int]
) -> None:
    # The same chained hashes on both sides: what the router recorded as computed is what the
    # engine's prefix cache finds (a big cache, so no eviction on either side).
    bm = BlockManager(num_blocks=64, block_size=BS)
    index = PrefixIndex()
    for n, tokens in enumerate(prompts):
        if not tokens:
            continue
        rid = f"r{n}"
        assert bm.allocate_slots(rid, len(tokens))
        bm.cache_blocks(rid, tokens, len(tokens))
        bm.free(rid)
        index.insert("w", prefix_block_hashes(tokens, BS), capacity=64)
    probe_hashes = prefix_block_hashes(probe, BS)
    full = len(probe_hashes)
    _, num_cached = bm.get_computed_blocks([*probe, 0])  # +1: the engine leaves one token
    assert min(index.match("w", probe_hashes), full) * BS == num_cached
