"""The KV cache memory of one engine and zero-copy byte views of its blocks.

Layout (see `pdserve.model.attention`): one tensor
`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, so block b across all layers
is the contiguous byte range `[b * block_bytes, (b + 1) * block_bytes)`. The transfer layer reads
and writes those ranges through `block_views`, which share memory with the tensor: no copy.
Pages are touched at allocation (zeros), so the first transfer into a block does not pay the
first-touch page faults.

One extra block past `num_blocks` is scratch (`scratch_block_id`): never allocated to a request
and never viewed by the transfer layer, it lets the KV canary compute a position without
writing into blocks that requests own (see `engine/canary.py`).

With `shared`, the tensor lives in an exported memfd arena (`transfer/arena.py`, a leaf module
of plain memory) instead of the heap: a same-host receiver then reads a handoff's blocks
straight from it.
"""

from __future__ import annotations

import logging
import math

import torch

from pdserve.errors import ConfigError, EngineError
from pdserve.model.weights import TORCH_DTYPES
from pdserve.transfer import arena
from pdserve.transfer.arena import Arena

log = logging.getLogger(__name__)


class KVCache:
    """The paged KV tensor and views of its blocks as bytes."""

    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str = "float32",
        shared: bool = False,
    ) -> None:
        """`shared`: the memory is an exported arena (`transfer/arena.py`), which a same-host
        receiver reads its KV from directly (one copy instead of two)."""
        if dtype not in TORCH_DTYPES:
            raise ConfigError(f"kv cache dtype: {dtype!r} is not one of {', '.join(TORCH_DTYPES)}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        # [num_blocks + 1 (scratch), num_layers, 2, block_size, num_kv_heads, head_dim]
        shape = (num_blocks + 1, num_layers, 2, block_size, num_kv_heads, head_dim)
        torch_dtype = TORCH_DTYPES[dtype]
        self.arena: Arena | None = None
        count = math.prod(shape)
        if shared:
            itemsize = torch.tensor([], dtype=torch_dtype).element_size()
            try:
                self.arena = arena.export(count * itemsize)
            except OSError as exc:  # no memfd here (old kernel, sandbox): two copies, then
                log.warning("KV cache on the heap, not shareable: %s", exc)
        if self.arena is not None:
            # A fresh memfd reads as zeroes, like torch.zeros.
            flat = torch.frombuffer(self.arena.map, dtype=torch_dtype, count=count)
            self.tensor = flat.view(shape)
        else:
            self.tensor = torch.zeros(shape, dtype=torch_dtype)
        self.scratch_block_id = num_blocks
        self._bytes = self.tensor.view(-1).view(torch.uint8).numpy()
        self.block_bytes = self._bytes.nbytes // (num_blocks + 1)
        # numpy arrays export the buffer protocol; the stubs do not say so.
        self._view = memoryview(self._bytes)  # type: ignore[arg-type]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str
    ) -> int:
        """Bytes one block occupies across all layers."""
        itemsize = torch.tensor([], dtype=TORCH_DTYPES[dtype]).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize

    def block_views(self, block_ids: list[int]) -> list[memoryview]:
        """One writable byte view per block, in the given order, sharing the cache's memory."""
        views: list[memoryview] = []
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise EngineError(f"block id {block_id} outside 0..{self.num_blocks - 1}")
            start = block_id * self.block_bytes
            views.append(self._view[start : start + self.block_bytes])
        return views
