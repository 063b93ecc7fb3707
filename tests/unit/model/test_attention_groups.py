"""Decode grouping: similar widths share a padded call, and every sequence is in one group."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdserve.model.attention import _group_by_width, build_metadata


def test_groups_split_where_width_grows_past_one_and_a_half() -> None:
    widths = [10, 2, 3, 4, 16, 24, 6]
    groups = _group_by_width(widths)
    assert [[widths[i] for i in g] for g in groups] == [[2, 3], [4, 6], [10], [16, 24]]


def test_at_most_four_groups() -> None:
    widths = [1, 2, 4, 8, 16, 32, 64]
    assert [[widths[i] for i in g] for g in _group_by_width(widths)] == [
        [1],
        [2],
        [4],
        [8, 16, 32, 64],
    ]


@given(st.lists(st.integers(1, 40), max_size=40))
def test_every_sequence_in_exactly_one_group(widths: list[int]) -> None:
    groups = _group_by_width(widths)
    assert sorted(i for g in groups for i in g) == list(range(len(widths)))
    assert len(groups) <= 4


def test_metadata_masks_only_padded_groups() -> None:
    # Two decode sequences of equal length need no mask; a third, shorter one in the same
    # group (width 2 vs 2 blocks of 4) gets one.
    meta = build_metadata([([0, 1], 7, 8), ([2, 3], 7, 8)], block_size=4)
    assert len(meta.decode_groups) == 1 and meta.decode_groups[0].mask is None
    meta = build_metadata([([0, 1], 7, 8), ([2, 3], 4, 5)], block_size=4)
    assert meta.decode_groups[0].mask is not None
    assert meta.decode_groups[0].mask[1, 0, 0].tolist() == [True] * 5 + [False] * 3
