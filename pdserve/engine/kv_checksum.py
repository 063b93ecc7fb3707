"""A 64-bit checksum of KV blocks computed where they live: a Triton kernel on a GPU.

The host path checks each chunk with xxh3 over host bytes. KV that moves device to device
(`kv_ipc`) never visits the host, so its check must run on the device too. The function, per
range of n bytes read as little-endian 64-bit words w_0 .. w_{k-1} (the last one zero-padded):

    sum_i mix(w_i XOR (i * STRIDE))  mod 2^64,   then   mix(that XOR mix(n))

`mix` (multiply by odd constants, xor-shifts) is a bijection of 64-bit words, so changing any one
word always changes its term and so the sum: a single corrupted word is always caught, and
random corruption of several collides with probability about 2^-64. The word index enters each
term, so swapped words are caught; the length enters the result, so a truncated range is too.
The index counts from the start of each range, so a block hashes the same at any block id: the
sender's block 17 and the receiver's block 42 agree when their bytes do.

One kernel launch hashes any list of blocks of a cache tensor: programs over (block, stripe),
each stripe summing every `NUM_STRIPES`-th tile of its block; the few partial sums per block are
combined on the host in Python integers (never the KV bytes). CPU tensors use the reference, the
same function in numpy's uint64 arithmetic (which wraps by definition): the tests' oracle.

Verification: checked on the CPU only, against the reference through Triton's interpreter
(`TRITON_INTERPRET=1`). It has never run on a GPU: its speed there is unmeasured
(`make gpu-check`, step `device_transfer`).
"""

from __future__ import annotations

import os
from typing import Any, Literal

import numpy as np
import torch

from pdserve.model.triton_attention import triton_available

_MASK = (1 << 64) - 1
STRIDE = 0x9E3779B97F4A7C15  # odd: i * STRIDE is a bijection of indices mod 2^64
_C1 = 0xFF51AFD7ED558CCD
_C2 = 0xC4CEB9FE1A85EC53
# Words per tile and stripes per block: a 1 MiB block is 128 Ki words, 4 stripes of 8 tiles.
TILE_WORDS = 4096
NUM_STRIPES = 4

Impl = Literal["auto", "triton", "reference"]

tl: Any = None
_cached_kernel: Any = None


def _mix_int(x: int) -> int:
    """`mix` on one Python integer (the final combine and the length term)."""
    x ^= x >> 33
    x = (x * _C1) & _MASK
    x ^= x >> 33
    x = (x * _C2) & _MASK
    return x ^ (x >> 33)


def _finish(total: int, num_bytes: int) -> int:
    return _mix_int((total & _MASK) ^ _mix_int(num_bytes))


def _mix_words(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(_C1)
    x = x ^ (x >> np.uint64(33))
    x = x * np.uint64(_C2)
    return x ^ (x >> np.uint64(33))


def reference_checksum(data: bytes | memoryview | np.ndarray) -> int:
    """The checksum of these bytes in numpy (the oracle; also the CPU path)."""
    raw = np.frombuffer(data, dtype=np.uint8)
    n = raw.size
    padded = np.zeros(-(-n // 8) * 8, dtype=np.uint8)
    padded[:n] = raw
    words = padded.view("<u8")
    index = np.arange(words.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        terms = _mix_words(words ^ (index * np.uint64(STRIDE)))
        total = int(terms.sum(dtype=np.uint64))
    return _finish(total, n)


def _kernel() -> Any:
    """The jitted kernel, defined on first use so that importing this module needs no Triton."""
    global tl, _cached_kernel
    if _cached_kernel is not None:
        return _cached_kernel
    import triton
    import triton.language

    tl = triton.language

    @triton.jit
    def checksum_kernel(  # type: ignore[no-untyped-def]  # Triton reads annotations itself
        words_ptr, ids_ptr, partial_ptr, block_words, num_tiles,
        TILE: tl.constexpr, STRIPES: tl.constexpr,
    ):  # fmt: skip
        which = tl.program_id(0)
        stripe = tl.program_id(1)
        block = tl.load(ids_ptr + which).to(tl.int64)
        base = words_ptr + block * block_words
        offs = tl.arange(0, TILE)
        acc = tl.zeros([TILE], dtype=tl.uint64)
        for tile in range(stripe, num_tiles, STRIPES):
            index = (tile * TILE + offs).to(tl.int64)
            mask = index < block_words
            w = tl.load(base + index, mask=mask, other=0).to(tl.uint64, bitcast=True)
            x = w ^ (index.to(tl.uint64) * 0x9E3779B97F4A7C15)
            x = x ^ (x >> 33)
            x = x * 0xFF51AFD7ED558CCD
            x = x ^ (x >> 33)
            x = x * 0xC4CEB9FE1A85EC53
            x = x ^ (x >> 33)
            acc += tl.where(mask, x, 0)
        total = tl.sum(acc, axis=0)
        tl.store(partial_ptr + which * STRIPES + stripe, total.to(tl.int64, bitcast=True))

    _cached_kernel = checksum_kernel
    return checksum_kernel


def _use_triton(t: torch.Tensor, impl: Impl) -> bool:
    if impl == "reference":
        return False
    if impl == "triton":
        if not triton_available():
            raise ValueError("kv_checksum: impl='triton' but Triton does not import")
        return True
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    return triton_available() and (t.device.type == "cuda" or interpreting)


def _rows_as_words(cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(the cache's bytes as int64 words, words per block, bytes per block)."""
    if not cache.is_contiguous():
        raise ValueError("kv_checksum: the cache tensor must be contiguous")
    block_bytes = cache[0].numel() * cache.element_size() if cache.shape[0] else 0
    if block_bytes % 8:
        raise ValueError(f"kv_checksum: blocks of {block_bytes} bytes are not whole 64-bit words")
    words = cache.view(-1).view(torch.uint8).view(torch.int64)
    return words, block_bytes // 8, block_bytes


def block_checksums(cache: torch.Tensor, block_ids: list[int], impl: Impl = "auto") -> list[int]:
    """The checksum of each listed block (`cache[block_id]`'s bytes), one kernel launch on a GPU;
    `impl` forces the kernel ("triton", e.g. under the interpreter) or the reference."""
    if not block_ids:
        return []
    if min(block_ids) < 0 or max(block_ids) >= cache.shape[0]:
        raise ValueError(f"kv_checksum: block ids outside 0..{cache.shape[0] - 1}")
    words, block_words, block_bytes = _rows_as_words(cache)
    if not _use_triton(cache, impl):
        rows = cache.view(cache.shape[0], -1).view(torch.uint8)
        return [reference_checksum(rows[b].cpu().numpy()) for b in block_ids]
    ids = torch.tensor(block_ids, dtype=torch.int64, device=cache.device)
    partial = torch.empty(len(block_ids) * NUM_STRIPES, dtype=torch.int64, device=cache.device)
    num_tiles = -(-block_words // TILE_WORDS)
    grid = (len(block_ids), NUM_STRIPES)
    _kernel()[grid](words, ids, partial, block_words, num_tiles, TILE_WORDS, NUM_STRIPES)
    # A few words per block cross to the host, never the blocks.
    sums = partial.view(len(block_ids), NUM_STRIPES).cpu().tolist()
    return [_finish(sum(s & _MASK for s in row), block_bytes) for row in sums]


def device_checksum(t: torch.Tensor, impl: Impl = "auto") -> int:
    """The checksum of a contiguous tensor's bytes, computed on its device (any dtype; a length
    that is not whole words is hashed on the host, as the reference)."""
    if not t.is_contiguous():
        raise ValueError("kv_checksum: the tensor must be contiguous")
    num_bytes = t.numel() * t.element_size()
    if num_bytes == 0 or num_bytes % 8 or not _use_triton(t, impl):
        return reference_checksum(t.reshape(-1).view(torch.uint8).cpu().numpy())
    return block_checksums(t.reshape(1, -1), [0], impl)[0]
