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

Staging. A cache on a GPU (or on the CPU with `staged`, which runs the same path in tests) is
not host memory the transports can read or write, so `block_views` are views of a host
mirror of the same layout (pinned on CUDA, so the copies are DMA; the exported arena when
`shared`). The mirror is only a staging area: `stage_out(ids)` copies blocks from the device
before their bytes are sent, `stage_in(ids)` copies received (verified) blocks to the device.
The engine calls them at the hand-over points, for exactly the blocks that cross: a block the
mirror did not receive (one of this engine's cached prefix blocks) is never staged in over the
device's copy.
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
        device: torch.device | str = "cpu",
        staged: bool = False,
    ) -> None:
        """`shared`: the host memory is an exported arena (`transfer/arena.py`), which a
        same-host receiver reads its KV from directly (one copy instead of two). `staged` (always
        on for a device other than the CPU): transfers go through a host mirror (see above)."""
        if dtype not in TORCH_DTYPES:
            raise ConfigError(f"kv cache dtype: {dtype!r} is not one of {', '.join(TORCH_DTYPES)}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        # [num_blocks + 1 (scratch), num_layers, 2, block_size, num_kv_heads, head_dim]
        shape = (num_blocks + 1, num_layers, 2, block_size, num_kv_heads, head_dim)
        torch_dtype = TORCH_DTYPES[dtype]
        self.device = torch.device(device)
        self.staged = staged or self.device.type != "cpu"
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
            host = torch.frombuffer(self.arena.map, dtype=torch_dtype, count=count).view(shape)
        else:
            # Pinned only where there is a GPU to DMA to (a CPU-only build cannot pin).
            pin = self.device.type == "cuda"
            host = torch.zeros(shape, dtype=torch_dtype, pin_memory=pin)
        # The tensor the model computes with; the host memory transfers read and write.
        self.tensor = (
            torch.zeros(shape, dtype=torch_dtype, device=self.device) if self.staged else host
        )
        self.host = host
        self.scratch_block_id = num_blocks
        self._bytes = host.view(-1).view(torch.uint8).numpy()
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
        """One writable byte view per block, in the given order, sharing the cache's host
        memory (the mirror of a staged cache: `stage_out` first to read current KV)."""
        views: list[memoryview] = []
        for block_id in block_ids:
            self._check(block_id)
            start = block_id * self.block_bytes
            views.append(self._view[start : start + self.block_bytes])
        return views

    def stage_out(self, block_ids: list[int]) -> None:
        """Copy these blocks from the device to the host mirror (no-op unless staged); returns
        once the bytes are there."""
        self._stage(block_ids, to_host=True)

    def stage_in(self, block_ids: list[int]) -> None:
        """Copy these blocks from the host mirror to the device (no-op unless staged); work
        queued on the device after this sees them."""
        self._stage(block_ids, to_host=False)

    def _stage(self, block_ids: list[int], to_host: bool) -> None:
        if not self.staged or not block_ids:
            return
        index = self._index(block_ids)
        dst, src = (self.host, self.tensor) if to_host else (self.tensor, self.host)
        if self.device.type == "cpu":
            dst.index_copy_(0, index, src.index_select(0, index))
            return
        # Block by block between device memory and the pinned mirror: DMA with no temporary.
        # Into the device, asynchronous: the next step runs on the same stream, after these
        # copies, and a block's mirror is not rewritten before its next hand-over.
        for block_id in block_ids:
            dst[block_id].copy_(src[block_id], non_blocking=True)
        if to_host:
            torch.cuda.synchronize(self.device)

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        for block_id in block_ids:
            self._check(block_id)
        return torch.tensor(block_ids, dtype=torch.long)

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise EngineError(f"block id {block_id} outside 0..{self.num_blocks - 1}")
