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
stripe p of S summing tiles p, p + S, ... of its block, with S chosen so that a launch has about
`TARGET_PROGRAMS` programs whether it hashes one large range or a thousand blocks. The partial
sums (8 bytes a program: 16 KB, or 8 bytes a block past 2048 blocks) are combined on the host in
Python integers; the KV bytes never leave the device. A range that is not whole words gets its
zero-padded last word from a second, one-program launch over an 8-byte device buffer. CPU
tensors use the reference, the same function in numpy's uint64 arithmetic (which wraps by
definition): the tests' oracle. On a CUDA tensor without Triton the reference is used too, and
it copies the bytes to the host (CUDA builds of torch ship Triton).

Verification: checked on the CPU only, against the reference through Triton's interpreter
(`TRITON_INTERPRET=1`, Triton 3.9); compiled for sm_90 on a machine without a GPU (16-byte
loads, at most 126 registers, no spills). It has never run on a GPU: its results and speed
there are unverified (`make gpu-check`, step `device_transfer`, checks both).
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
# Words per tile (16 per thread at 4 warps: at most 126 registers on sm_90, where 4096 words took
# 164), and about how many programs a launch wants (~16 per SM on an H100).
TILE_WORDS = 2048
TARGET_PROGRAMS = 2048

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
        words_ptr, ids_ptr, partial_ptr, block_words, num_tiles, first_index,
        TILE: tl.constexpr,
    ):  # fmt: skip
        # Program (which, stripe) of S stripes sums tiles stripe, stripe + S, ... of block
        # ids[which] (`block_words` words from words_ptr + id * block_words) into
        # partial[which * S + stripe]; word i of the block is hashed as index first_index + i.
        which = tl.program_id(0)
        stripe = tl.program_id(1)
        num_stripes = tl.num_programs(1)
        block = tl.load(ids_ptr + which).to(tl.int64)
        base = words_ptr + block * block_words  # int64: a cache may exceed 2^31 words
        offs = tl.arange(0, TILE)
        acc = tl.zeros([TILE], dtype=tl.uint64)
        for tile in range(stripe, num_tiles, num_stripes):
            index = tl.cast(tile, tl.int64) * TILE + offs  # int64: a range may pass 2^31 words
            mask = index < block_words
            w = tl.load(base + index, mask=mask, other=0).to(tl.uint64, bitcast=True)
            # uint64 arithmetic wraps mod 2^64, and `>>` on it shifts in zeros. The constants
            # are `STRIDE`, `_C1` and `_C2` (the tests hold the kernel to the reference).
            x = w ^ ((index + first_index).to(tl.uint64) * 0x9E3779B97F4A7C15)
            x = x ^ (x >> 33)
            x = x * 0xFF51AFD7ED558CCD
            x = x ^ (x >> 33)
            x = x * 0xC4CEB9FE1A85EC53
            x = x ^ (x >> 33)
            acc += tl.where(mask, x, 0)
        total = tl.sum(acc, axis=0)
        tl.store(partial_ptr + which * num_stripes + stripe, total.to(tl.int64, bitcast=True))

    _cached_kernel = checksum_kernel
    return checksum_kernel


def _use_triton(t: torch.Tensor, impl: Impl) -> bool:
    if impl not in ("auto", "triton", "reference"):
        raise ValueError(f"kv_checksum: impl must be auto, triton or reference, got {impl!r}")
    if impl == "reference":
        return False
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if impl == "triton":
        if not triton_available():
            raise ValueError("kv_checksum: impl='triton' but Triton does not import")
        if t.device.type != "cuda" and not interpreting:
            raise ValueError(f"kv_checksum: impl='triton' on {t.device} needs TRITON_INTERPRET=1")
        return True
    return triton_available() and (t.device.type == "cuda" or interpreting)


def _sums(words: torch.Tensor, block_ids: list[int], block_words: int) -> list[int]:
    """The word sum of each listed block of `words` (int64 [num_blocks * block_words]), by one
    launch whose partial sums are the only bytes that reach the host."""
    device = words.device
    num_tiles = -(-block_words // TILE_WORDS)
    stripes = max(1, min(num_tiles, TARGET_PROGRAMS // len(block_ids)))
    ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
    partial = torch.empty(len(block_ids) * stripes, dtype=torch.int64, device=device)
    _launch(words, ids, partial, (len(block_ids), stripes), block_words, num_tiles, 0)
    rows = partial.view(len(block_ids), stripes).cpu().tolist()  # [blocks, stripes] int64
    return [sum(row) & _MASK for row in rows]


def _launch(
    words: torch.Tensor,
    ids: torch.Tensor,
    partial: torch.Tensor,
    grid: tuple[int, int],
    block_words: int,
    num_tiles: int,
    first_index: int,
) -> None:
    kernel = _kernel()[grid]
    kernel(words, ids, partial, block_words, num_tiles, first_index, TILE=TILE_WORDS, num_warps=4)


def _as_words(data: torch.Tensor) -> torch.Tensor:
    """Bytes (uint8 [8k], contiguous) as int64 words; copied on their device if misaligned."""
    if data.storage_offset() % 8 or data.data_ptr() % 8:
        data = data.clone()  # a view starting mid-word (rare): aligned by a device copy
    return data.view(torch.int64)


def block_checksums(cache: torch.Tensor, block_ids: list[int], impl: Impl = "auto") -> list[int]:
    """The checksum of each listed block (`cache[block_id]`'s bytes), one kernel launch on a GPU;
    `impl` forces the kernel ("triton", e.g. under the interpreter) or the reference."""
    if not cache.is_contiguous():
        raise ValueError("kv_checksum: the cache tensor must be contiguous")
    if not block_ids:
        return []
    if min(block_ids) < 0 or max(block_ids) >= cache.shape[0]:
        raise ValueError(f"kv_checksum: block ids outside 0..{cache.shape[0] - 1}")
    block_bytes = cache[0].numel() * cache.element_size()
    if not _use_triton(cache, impl):
        rows = cache.view(-1).view(torch.uint8).view(cache.shape[0], block_bytes)
        return [reference_checksum(rows[b].cpu().numpy()) for b in block_ids]
    if block_bytes % 8 or block_bytes == 0:
        # Blocks that are not whole words (no real KV layout): each hashed with its tail.
        return [device_checksum(cache[b], impl) for b in block_ids]
    words = _as_words(cache.view(-1).view(torch.uint8))
    sums = _sums(words, list(block_ids), block_bytes // 8)
    return [_finish(total, block_bytes) for total in sums]


def device_checksum(t: torch.Tensor, impl: Impl = "auto") -> int:
    """The checksum of a contiguous tensor's bytes (any dtype), computed on its device."""
    if not t.is_contiguous():
        raise ValueError("kv_checksum: the tensor must be contiguous")
    data = t.reshape(-1).view(torch.uint8)  # [n] bytes, the tensor's memory
    if not _use_triton(t, impl):
        return reference_checksum(data.cpu().numpy())
    num_words, tail_bytes = divmod(data.numel(), 8)
    total = 0
    if num_words:
        total += _sums(_as_words(data[: num_words * 8]), [0], num_words)[0]
    if tail_bytes:
        # The last word, zero-padded in an 8-byte buffer on the device, hashed at its index.
        tail = torch.zeros(8, dtype=torch.uint8, device=data.device)
        tail[:tail_bytes] = data[num_words * 8 :]
        ids = torch.zeros(1, dtype=torch.int64, device=data.device)
        partial = torch.empty(1, dtype=torch.int64, device=data.device)
        _launch(tail.view(torch.int64), ids, partial, (1, 1), 1, 1, num_words)
        total += int(partial.item())
    return _finish(total, data.numel())
