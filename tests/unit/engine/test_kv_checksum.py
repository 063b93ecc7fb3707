"""The device checksum of KV blocks: the Triton kernel against its numpy reference, and the
properties the transfer relies on (a flipped byte, a swapped word, a shorter range and a block
moved to another id are all told apart or not, as they should be).

The kernel runs on CPU tensors only under Triton's interpreter, which must be on before Triton
defines the kernel: its cases run in a child process (this file as a script) that reports each
case's traceback or None (`tests/triton_interpreter.py`).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_interpreter import errors_in_interpreter, report

from pdserve.engine import kv_checksum
from pdserve.engine.kv_checksum import (
    TILE_WORDS,
    block_checksums,
    device_checksum,
    reference_checksum,
)
from pdserve.model.triton_attention import triton_available


def _cache(num_blocks: int, block: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, *block), generator=gen).to(dtype)


def _case_blocks_match_reference() -> None:
    for dtype, block in [
        (torch.bfloat16, (2, 2, 16, 4, 64)),  # 32 KiB: 4096 words, two tiles
        (torch.float32, (3, 2, 16, 8, 128)),  # 384 KiB: 24 tiles
        (torch.float16, (1, 2, 3, 1, 4)),  # 48 bytes: a partial tile
    ]:
        cache = _cache(9, block, dtype, seed=1)
        ids = [0, 8, 3, 3, 5]
        assert block_checksums(cache, ids, impl="triton") == block_checksums(
            cache, ids, impl="reference"
        )


def _case_whole_tensor_matches_reference() -> None:
    # Whole words, one tile and several stripes, and lengths with a tail of 1..7 bytes.
    for n in (1, 2, 3 * TILE_WORDS + 5, 70001 * 2):
        t = _cache(1, (n,), torch.float32, seed=n)[0]
        assert device_checksum(t, "triton") == device_checksum(t, "reference"), n
    for n in (1, 7, 9, 8 * TILE_WORDS + 3, 2 * 70001 + 1):
        t = torch.randint(
            0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n)
        )
        assert device_checksum(t, "triton") == reference_checksum(t.numpy()), n
    for n in (3, 5):
        t = _cache(1, (n,), torch.float16, seed=n)[0]  # 6 and 10 bytes
        assert device_checksum(t, "triton") == device_checksum(t, "reference"), n


def _case_misaligned_views_match_reference() -> None:
    # Views that start mid-word: the kernel reads an aligned device copy of them.
    raw = torch.randint(
        0, 256, (4099,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)
    )
    for start, stop in [(1, 4099), (3, 11), (5, 4096), (8, 4099)]:
        view = raw[start:stop]
        assert device_checksum(view, "triton") == reference_checksum(view.numpy()), (start, stop)


@settings(max_examples=60, deadline=None, database=None)
@given(
    data=st.binary(max_size=300),
    dtype=st.sampled_from([torch.uint8, torch.int16, torch.float32, torch.float64]),
)
def _case_random_ranges_match_reference(data: bytes, dtype: torch.dtype) -> None:
    size = torch.empty(0, dtype=dtype).element_size()
    data = data[: len(data) // size * size]
    t = torch.tensor(list(data), dtype=torch.uint8).view(dtype)  # may be empty
    assert device_checksum(t, "triton") == reference_checksum(data)


def _case_many_blocks_and_blocks_of_part_words() -> None:
    # 300 blocks in one launch (6 stripes each), ids repeated and out of order.
    cache = _cache(300, (2, 2, 4, 2, 16), torch.bfloat16, seed=6)
    ids = [*range(299, -1, -1), 7, 7]
    assert block_checksums(cache, ids, impl="triton") == block_checksums(
        cache, ids, impl="reference"
    )
    # Few programs for many tiles: each stripe loops over several tiles.
    big = _cache(6, (3, 2, 16, 8, 128), torch.float32, seed=8)
    saved, kv_checksum.TARGET_PROGRAMS = kv_checksum.TARGET_PROGRAMS, 4
    try:
        got = block_checksums(big, [5, 1], impl="triton"), device_checksum(big, "triton")
    finally:
        kv_checksum.TARGET_PROGRAMS = saved
    assert got == (
        block_checksums(big, [5, 1], impl="reference"),
        device_checksum(big, "reference"),
    )
    odd = _cache(5, (3,), torch.float16, seed=7)  # 6-byte blocks: each hashed with its tail
    assert block_checksums(odd, [4, 0, 2], impl="triton") == [
        reference_checksum(odd[b].numpy().tobytes()) for b in (4, 0, 2)
    ]
    assert block_checksums(odd, [1], impl="triton") == [device_checksum(odd[1], "triton")]


def _case_every_flipped_byte_is_caught() -> None:
    cache = _cache(4, (2, 2, 16, 4, 64), torch.bfloat16, seed=2)
    want = block_checksums(cache, [0, 1, 2, 3], impl="triton")
    block_bytes = cache[0].numel() * 2
    rng = random.Random(0)
    for _ in range(40):
        block, offset, bit = rng.randrange(4), rng.randrange(block_bytes), rng.randrange(8)
        bad = cache.clone()
        bad[block].view(-1).view(torch.uint8)[offset] ^= 1 << bit
        got = block_checksums(bad, [0, 1, 2, 3], impl="triton")
        assert [g != w for g, w in zip(got, want, strict=True)] == [i == block for i in range(4)]


CASES: dict[str, Callable[[], None]] = {
    "blocks_match_reference": _case_blocks_match_reference,
    "whole_tensor_matches_reference": _case_whole_tensor_matches_reference,
    "misaligned_views_match_reference": _case_misaligned_views_match_reference,
    "random_ranges_match_reference": _case_random_ranges_match_reference,
    "many_blocks_and_blocks_of_part_words": _case_many_blocks_and_blocks_of_part_words,
    "every_flipped_byte_is_caught": _case_every_flipped_byte_is_caught,
}


@pytest.fixture(scope="module")
def interpreter_errors() -> dict[str, str | None]:
    return errors_in_interpreter(__file__)


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_in_interpreter(name: str, interpreter_errors: dict[str, str | None]) -> None:
    error = interpreter_errors[name]
    assert error is None, error


# -- In this process: the reference and the CPU path, no Triton. --


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=1, max_size=200), where=st.integers(0), bit=st.integers(0, 7))
def test_a_flipped_bit_always_changes_the_checksum(data: bytes, where: int, bit: int) -> None:
    bad = bytearray(data)
    bad[where % len(data)] ^= 1 << bit
    assert reference_checksum(bytes(bad)) != reference_checksum(data)


@settings(max_examples=100, deadline=None)
@given(words=st.lists(st.integers(0, 2**64 - 1), min_size=2, max_size=20, unique=True))
def test_swapped_words_change_the_checksum(words: list[int]) -> None:
    data = b"".join(w.to_bytes(8, "little") for w in words)
    swapped = b"".join(w.to_bytes(8, "little") for w in [words[1], words[0], *words[2:]])
    assert reference_checksum(swapped) != reference_checksum(data)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=64))
def test_appended_zero_bytes_change_the_checksum(data: bytes) -> None:
    # Zero padding of the last word is not the same as zero bytes of data: the length counts.
    assert reference_checksum(data + b"\0") != reference_checksum(data)


def test_a_block_hashes_the_same_at_any_block_id() -> None:
    cache = _cache(5, (2, 2, 4, 2, 8), torch.float32, seed=3)
    cache[4] = cache[1]
    a, b = block_checksums(cache, [1, 4])
    assert a == b and a != block_checksums(cache, [2])[0]


def test_the_cpu_path_hashes_each_block_as_the_reference_hashes_its_bytes() -> None:
    cache = _cache(3, (1, 2, 4, 2, 8), torch.bfloat16, seed=4)
    got = block_checksums(cache, [2, 0])
    assert got == [reference_checksum(cache[i].view(torch.int16).numpy().tobytes()) for i in (2, 0)]
    assert device_checksum(cache[1]) == reference_checksum(cache[1].view(torch.int16).numpy())


def test_an_empty_tensor_and_no_blocks() -> None:
    assert device_checksum(torch.empty(0)) == reference_checksum(b"")
    assert block_checksums(_cache(2, (4,), torch.float32, 0), []) == []


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: block_checksums(_cache(3, (4,), torch.float32, 0), [3]), "outside 0..2"),
        (lambda: block_checksums(_cache(3, (4,), torch.float32, 0), [-1]), "outside"),
        (lambda: device_checksum(torch.zeros(4), impl="fast"), "impl must be"),  # type: ignore[arg-type]
        (
            lambda: block_checksums(_cache(3, (4, 2), torch.float32, 0).transpose(1, 2), [0]),
            "contiguous",
        ),
        (lambda: device_checksum(torch.zeros(4, 4).t()), "contiguous"),
    ],
)
def test_bad_arguments_name_themselves(call: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_the_kernel_on_cpu_tensors_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if not triton_available():
        pytest.skip("triton is not installed")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        device_checksum(torch.zeros(4), impl="triton")


if __name__ == "__main__":  # the child: TRITON_INTERPRET=1 was set before anything imported
    report(CASES)
