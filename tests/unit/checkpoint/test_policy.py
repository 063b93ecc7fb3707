"""Checkpoint policy: parsing the flag and which blocks each decision sends."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.errors import ConfigError
from pdserve.protocol.checkpoint_policy import CheckpointPolicy, Mode


@pytest.mark.parametrize("text", ["off", "prompt", "every-1", "every-8"])
def test_parse_round_trips(text: str) -> None:
    assert str(CheckpointPolicy.parse(text)) == text


@pytest.mark.parametrize("text", ["", "every", "every-0", "every--1", "always", "every-x"])
def test_bad_values_name_the_flag(text: str) -> None:
    with pytest.raises(ConfigError, match="--checkpoint"):
        CheckpointPolicy.parse(text)


def test_prompt_sends_the_prompt_blocks_once() -> None:
    p = CheckpointPolicy(Mode.PROMPT)
    assert p.next_batch(40, 10, 0, 4) == range(0, 10)
    assert p.next_batch(40, 12, 10, 4) == range(10, 10)
    assert p.next_batch(42, 12, 0, 4) == range(0, 10)  # the partial prompt block is not sent


def test_every_n_batches_generated_blocks() -> None:
    p = CheckpointPolicy(Mode.EVERY, 2)
    assert p.next_batch(16, 4, 0, 4) == range(0, 4)
    assert p.next_batch(16, 5, 4, 4) == range(4, 4)
    assert p.next_batch(16, 6, 4, 4) == range(4, 6)
    assert CheckpointPolicy().next_batch(16, 6, 0, 4) == range(0, 0)


@given(
    st.sampled_from(["off", "prompt", "every-1", "every-3"]),
    st.integers(1, 200),
    st.lists(st.integers(0, 5), max_size=30),
)
def test_batches_are_contiguous_and_never_ahead_of_the_computed_kv(
    text: str, num_prompt_tokens: int, steps: list[int]
) -> None:
    p = CheckpointPolicy.parse(text)
    bs = 4
    full = num_prompt_tokens // bs
    sent = 0
    for grow in steps:
        full += grow
        batch = p.next_batch(num_prompt_tokens, full, sent, bs)
        assert batch.start == sent and batch.stop <= full
        if p.mode is Mode.OFF:
            assert len(batch) == 0
        if p.mode is Mode.PROMPT:
            assert batch.stop <= num_prompt_tokens // bs
        sent = batch.stop
    sent = p.next_batch(num_prompt_tokens, full, sent, bs).stop
    if p.mode is Mode.EVERY:
        assert full - sent < p.every_n_blocks or full == sent
