"""The host-memory checkpoint tier: chained keys, room, owners, refusals (each counted)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.checkpoint.holder import BlockRun
from pdserve.checkpoint.host_tier import HostTier
from pdserve.engine.block_manager import prefix_block_hashes
from pdserve.errors import CheckpointRefused

BS = 4
BLOCK_BYTES = 8
FP = "fp-a"


def _fill(tier: HostTier, owner: str, tokens: list[int], start_block: int = 0) -> int:
    """Put blocks start_block.. of `tokens` (full blocks only) with recognisable bytes."""
    hashes = prefix_block_hashes(tokens, BS)
    parent = hashes[start_block - 1] if start_block else 0
    blocks = [tokens[i * BS : (i + 1) * BS] for i in range(start_block, len(hashes))]
    put = tier.begin_put(BlockRun(owner, FP, parent, (start_block + 1) * BS, blocks))
    for i, buffer in enumerate(put.buffers):
        buffer[:] = bytes([start_block + i]) * BLOCK_BYTES
    n = tier.commit(put)
    tier.check_invariants()
    return n


def test_put_then_longest_prefix_and_read() -> None:
    tier = HostTier(1024, BS, BLOCK_BYTES)
    tokens = list(range(12))  # 3 blocks
    assert _fill(tier, "r1", tokens[:8]) == 2
    assert _fill(tier, "r1", tokens, start_block=2) == 3
    hashes = prefix_block_hashes(tokens + [99] * 4, BS)
    hit = tier.longest_prefix(hashes, FP)
    assert (hit.num_blocks, hit.version) == (3, 12)
    views = tier.read(hashes[:3], FP)
    assert [bytes(v) for v in views] == [bytes([i]) * BLOCK_BYTES for i in range(3)]
    assert tier.used_bytes == 3 * BLOCK_BYTES
    assert tier.release("r1") == 3
    assert (tier.used_bytes, tier.num_blocks) == (0, 0)
    assert tier.longest_prefix(hashes, FP).num_blocks == 0
    tier.check_invariants()


def test_a_put_that_does_not_continue_a_held_prefix_is_refused() -> None:
    tier = HostTier(1024, BS, BLOCK_BYTES)
    tokens = list(range(12))
    with pytest.raises(CheckpointRefused) as err:
        _fill(tier, "r1", tokens, start_block=1)
    assert err.value.reason == "chain"
    with pytest.raises(CheckpointRefused) as err:
        tier.begin_put(BlockRun("r1", FP, 0, 6, [tokens[:4]]))
    assert err.value.reason == "version"
    with pytest.raises(CheckpointRefused) as err:
        tier.begin_put(BlockRun("r1", FP, 0, 4, [tokens[:3]]))
    assert err.value.reason == "version"
    assert tier.refused == {"chain": 1, "version": 2}
    assert tier.reserved_bytes == 0


def test_full_tier_refuses_before_any_byte_and_abort_gives_room_back() -> None:
    tier = HostTier(2 * BLOCK_BYTES, BS, BLOCK_BYTES)
    tokens = list(range(12))
    put = tier.begin_put(BlockRun("r1", FP, 0, BS, [tokens[:4], tokens[4:8]]))
    with pytest.raises(CheckpointRefused) as err:
        tier.begin_put(BlockRun("r2", FP, 0, BS, [tokens[:4]]))
    assert err.value.reason == "full"
    tier.abort(put)
    tier.abort(put)  # idempotent
    assert tier.reserved_bytes == 0
    assert _fill(tier, "r2", tokens[:8]) == 2
    assert tier.refused == {"full": 1}


def test_shared_prefix_is_held_once_and_freed_with_its_last_owner() -> None:
    tier = HostTier(1024, BS, BLOCK_BYTES)
    tokens = list(range(8))
    _fill(tier, "a", tokens)
    _fill(tier, "b", tokens)
    assert (tier.num_blocks, tier.used_bytes) == (2, 2 * BLOCK_BYTES)
    assert tier.release("a") == 0
    assert tier.longest_prefix(prefix_block_hashes(tokens, BS), FP).num_blocks == 2
    assert tier.release("b") == 2
    assert tier.release("b") == 0
    tier.check_invariants()


def test_changed_bytes_are_refused_counted_and_dropped() -> None:
    tier = HostTier(1024, BS, BLOCK_BYTES)
    tokens = list(range(8))
    put = tier.begin_put(BlockRun("r1", FP, 0, BS, [tokens[:4], tokens[4:]]))
    tier.commit(put)
    put.buffers[1][0] ^= 0xFF  # bit rot after the commit
    hashes = prefix_block_hashes(tokens, BS)
    with pytest.raises(CheckpointRefused) as err:
        tier.read(hashes, FP)
    assert err.value.reason == "checksum"
    assert tier.refused["checksum"] == 1
    assert tier.longest_prefix(hashes, FP).num_blocks == 1  # the bad block is gone
    tier.check_invariants()


def test_other_fingerprint_is_refused_and_counted() -> None:
    tier = HostTier(1024, BS, BLOCK_BYTES)
    tokens = list(range(8))
    _fill(tier, "r1", tokens)
    hashes = prefix_block_hashes(tokens, BS)
    assert tier.longest_prefix(hashes, "fp-b").num_blocks == 0
    with pytest.raises(CheckpointRefused) as err:
        tier.read(hashes, "fp-b")
    assert err.value.reason == "fingerprint"
    assert tier.refused["fingerprint"] == 2


def test_a_missing_block_is_refused_by_read() -> None:
    tier = HostTier(1024, BS, BLOCK_BYTES)
    with pytest.raises(CheckpointRefused) as err:
        tier.read(prefix_block_hashes(list(range(4)), BS), FP)
    assert err.value.reason == "missing"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["put", "release", "abort"]),
            st.integers(0, 3),  # owner
            st.integers(1, 3),  # blocks in the put
        ),
        max_size=40,
    )
)
def test_random_puts_and_releases_keep_the_accounting(ops: list[tuple[str, int, int]]) -> None:
    tier = HostTier(6 * BLOCK_BYTES, BS, BLOCK_BYTES)
    sent = {o: 0 for o in range(4)}
    # Owners 0 and 1 share a prompt; 2 and 3 have their own.
    streams = {o: [o // 2] * 4 + [100 + o] * 40 for o in range(4)}
    for op, owner, n in ops:
        name = f"r{owner}"
        tokens = streams[owner]
        try:
            if op == "put":
                start = sent[owner]
                hashes = prefix_block_hashes(tokens[: (start + n) * BS], BS)
                blocks = [tokens[i * BS : (i + 1) * BS] for i in range(start, start + n)]
                parent = hashes[start - 1] if start else 0
                put = tier.begin_put(BlockRun(name, FP, parent, (start + 1) * BS, blocks))
                tier.commit(put)
                sent[owner] = start + n
            elif op == "abort":
                put = tier.begin_put(BlockRun(name, FP, 0, BS, [tokens[:4]]))
                tier.abort(put)
            else:
                tier.release(name)
                sent[owner] = 0
        except CheckpointRefused as exc:
            assert exc.reason in ("full", "chain")
            if exc.reason == "chain":
                sent[owner] = 0  # its prefix was freed by a sharer's release: start over
        tier.check_invariants()
        for o in range(4):
            if sent[o]:
                hashes = prefix_block_hashes(streams[o][: sent[o] * BS], BS)
                assert tier.longest_prefix(hashes, FP).num_blocks == sent[o]
