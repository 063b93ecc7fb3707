"""The byte-range splitter: any payload, any block size, any frame target (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.transfer.byte_ranges import payload_views, split_payload


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(0, 12),
    block_bytes=st.integers(1, 700),
    frame_bytes=st.integers(1, 3000),
)
def test_chunks_cover_the_payload_once_and_map_onto_the_right_bytes(
    num_blocks: int, block_bytes: int, frame_bytes: int
) -> None:
    blocks = [bytearray((i * 7 + j) % 251 for j in range(block_bytes)) for i in range(num_blocks)]
    payload = b"".join(blocks)
    views = [memoryview(b) for b in blocks]
    chunks = list(split_payload(len(payload), frame_bytes))
    # In order, contiguous, none empty, none over the target, the whole payload once.
    assert all(0 < n <= frame_bytes for _, n in chunks)
    assert [o for o, _ in chunks] == [sum(n for _, n in chunks[:i]) for i in range(len(chunks))]
    assert sum(n for _, n in chunks) == len(payload)
    for offset, num in chunks:
        pieces = payload_views(views, block_bytes, offset, num)
        # Views into the blocks themselves (no copy), never crossing a block boundary.
        assert all(p.obj in blocks for p in pieces)
        assert all(0 < p.nbytes <= block_bytes for p in pieces)
        assert b"".join(bytes(p) for p in pieces) == payload[offset : offset + num]


def test_a_block_larger_than_a_frame_travels_in_pieces() -> None:
    # An 8 MiB block under a 4 MiB frame target: two chunks, each half of the block.
    assert list(split_payload(8 << 20, 4 << 20)) == [(0, 4 << 20), (4 << 20, 4 << 20)]


def test_out_of_range_is_refused() -> None:
    views = [memoryview(bytearray(10)) for _ in range(2)]
    with pytest.raises(ValueError, match="outside a payload of 2 blocks"):
        payload_views(views, 10, 15, 6)
    with pytest.raises(ValueError, match="frame_bytes"):
        list(split_payload(10, 0))
