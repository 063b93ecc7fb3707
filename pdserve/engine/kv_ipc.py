"""KV cache tensors shared between processes on one device: CUDA IPC, device to device.

Two workers on one GPU need not stage KV through the host: the prefill process exports its KV
cache once (`export_handle`), the decode process maps it (`map_peer`) and copies the blocks it
was offered straight into its own cache (`copy_blocks`), then checks what landed with a checksum
computed on the device (`kv_checksum.block_checksums`) against the sender's. The handle carries
plain fields (no pickle: it crosses a process boundary as data, never as code).

Why reading the sender's memory is safe where writing would not be (the argument of
`transfer/arena.py`): the receiver alone writes into its blocks, so fencing still stops every
write; the sender's cache is only read. If the sender reused a block before the receiver read
it (its lease ended), the receiver's checksum of what it copied differs from the one the sender
computed when it offered the block, and the attempt is refused.

On CUDA the handle is torch's own IPC export of the tensor's storage (`_share_cuda_`, what
`torch.multiprocessing` sends): the allocation stays alive while a peer holds it mapped. On the
CPU the stand-in is the shared-memory transport's memfd arena (`KVCache(shared=True)`), mapped
read-only through /proc/<pid>/fd: the same steps, so the CPU tests exercise them.

Verification: the CPU stand-in is tested; the CUDA IPC path has never run on a GPU
(`make gpu-check`, step `device_transfer`, measures it).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdserve.errors import TransportUnavailable
from pdserve.transfer import arena
from pdserve.transfer.arena import ArenaInfo

# Past this many runs of consecutive ids, one gather kernel beats a copy launch per run (a
# launch costs ~5 us; a 1 MiB block copies in under 1 us on an H100).
_MAX_RUN_COPIES = 8


class IpcUnavailable(TransportUnavailable):
    """A KV cache cannot be shared with, or mapped from, a peer process (the message says why)."""


@dataclass(frozen=True, slots=True)
class IpcHandle:
    """What a peer needs to map a KV cache tensor: where its bytes are and how to view them."""

    kind: str  # "cuda" (CUDA IPC) or "memfd" (the CPU stand-in)
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    # CUDA: torch's storage export (device, handle, sizes, ref counter, event), bytes as hex.
    cuda: tuple[object, ...] = ()
    storage_offset: int = 0  # elements
    # memfd: the owner's pid and fd, the arena's size and the tensor's byte offset in it.
    pid: int = 0
    fd: int = 0
    arena_bytes: int = 0
    byte_offset: int = 0

    def to_json(self) -> dict[str, Any]:
        """A JSON-able form (the CUDA export's handles as hex strings)."""
        return {
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "cuda": [x.hex() if isinstance(x, bytes) else x for x in self.cuda],
            "storage_offset": self.storage_offset,
            "pid": self.pid,
            "fd": self.fd,
            "arena_bytes": self.arena_bytes,
            "byte_offset": self.byte_offset,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> IpcHandle:
        """The handle `to_json` wrote; IpcUnavailable naming what is malformed."""
        try:
            # torch's CUDA export: device, handle, size, offset, ref-counter handle, its
            # offset, event handle, event sync; the three handles travel as hex.
            cuda = tuple(
                bytes.fromhex(x) if i in (1, 4, 6) else x for i, x in enumerate(doc["cuda"])
            )
            return cls(
                kind=str(doc["kind"]),
                dtype=str(doc["dtype"]),
                shape=tuple(int(n) for n in doc["shape"]),
                cuda=cuda,
                storage_offset=int(doc["storage_offset"]),
                pid=int(doc["pid"]),
                fd=int(doc["fd"]),
                arena_bytes=int(doc["arena_bytes"]),
                byte_offset=int(doc["byte_offset"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise IpcUnavailable(f"IPC handle: malformed ({type(exc).__name__}: {exc})") from None


def export_handle(cache: torch.Tensor) -> IpcHandle:
    """Share `cache` with peer processes: CUDA IPC on a GPU; on the CPU the tensor must lie in
    an exported arena (`KVCache(shared=True)`)."""
    if not cache.is_contiguous():
        raise IpcUnavailable("IPC export: the cache tensor must be contiguous")
    dtype = str(cache.dtype).removeprefix("torch.")
    shape = tuple(cache.shape)
    if cache.device.type == "cuda":
        exported = cache.untyped_storage()._share_cuda_()
        return IpcHandle(
            "cuda", dtype, shape, cuda=tuple(exported), storage_offset=int(cache.storage_offset())
        )
    if cache.device.type != "cpu":
        raise IpcUnavailable(f"IPC export: no sharing for {cache.device.type} tensors")
    view = memoryview(cache.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    found = arena.locate(view, arena.exported())
    if found is None:
        raise IpcUnavailable("IPC export: a CPU cache must live in an exported arena")
    owner = arena.exported()[found[0]].info
    return IpcHandle(
        "memfd", dtype, shape, pid=owner.pid, fd=owner.fd, arena_bytes=owner.num_bytes,
        byte_offset=found[1],
    )  # fmt: skip


def map_peer(handle: IpcHandle) -> torch.Tensor:
    """The peer's cache as a tensor in this process, to read from (never write: see above)."""
    dtype = getattr(torch, handle.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise IpcUnavailable(f"IPC handle: dtype {handle.dtype!r} is not a torch dtype")
    if handle.kind == "cuda":
        if not torch.cuda.is_available():
            raise IpcUnavailable("IPC map: a CUDA handle, but this process has no GPU")
        index = int(handle.cuda[0])  # type: ignore[call-overload]
        if not 0 <= index < torch.cuda.device_count():
            # Device numbers are those the exporter saw: CUDA_VISIBLE_DEVICES must agree.
            raise IpcUnavailable(
                f"IPC map: the cache is on cuda:{index}, this process sees"
                f" {torch.cuda.device_count()} device(s)"
            )
        torch.cuda.init()  # what torch's own rebuild does first: the allocator must exist
        storage = torch.UntypedStorage._new_shared_cuda(*handle.cuda)
        where = torch.device("cuda", index)
        out = torch.empty(0, dtype=dtype, device=where)
        count = int(np.prod(handle.shape))
        return out.set_(storage, handle.storage_offset, (count,), (1,)).view(handle.shape)
    if handle.kind != "memfd":
        raise IpcUnavailable(f"IPC handle: unknown kind {handle.kind!r}")
    mapping = arena.map_peer(ArenaInfo(handle.pid, handle.fd, handle.arena_bytes))
    if mapping is None:
        raise IpcUnavailable(f"IPC map: cannot open process {handle.pid}'s arena from here")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    count = int(np.prod(handle.shape))
    if handle.byte_offset + count * itemsize > handle.arena_bytes:
        raise IpcUnavailable("IPC handle: the tensor runs past its arena")
    with warnings.catch_warnings():
        # The mapping is read-only: torch warns that writes would fail; nothing here writes.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(mapping, dtype=dtype, count=count, offset=handle.byte_offset)
    return flat.view(handle.shape)


def runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the pairs' runs that are consecutive on both sides."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"copy_blocks: {len(src_ids)} source blocks, {len(dst_ids)} destinations")
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def copy_blocks(
    src: torch.Tensor,
    src_ids: list[int],
    dst: torch.Tensor,
    dst_ids: list[int],
    stream: torch.cuda.Stream | None = None,
) -> int:
    """Copy blocks `src[src_ids[i]]` into `dst[dst_ids[i]]` on one device (on `stream`, else the
    current one; nothing waits for it). Returns the number of copies queued."""
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(
            f"copy_blocks: blocks of {tuple(src.shape[1:])} {src.dtype} into"
            f" {tuple(dst.shape[1:])} {dst.dtype}"
        )
    if src.device != dst.device:
        raise IpcUnavailable(
            f"copy_blocks: source on {src.device}, destination on {dst.device}: device to device"
            " copies need one device"
        )
    for name, ids, cache in (("source", src_ids, src), ("destination", dst_ids, dst)):
        bad = [b for b in ids if not 0 <= b < cache.shape[0]]
        if bad:
            raise ValueError(f"copy_blocks: {name} block {bad[0]} outside 0..{cache.shape[0] - 1}")
    pieces = runs(src_ids, dst_ids)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        if len(pieces) <= _MAX_RUN_COPIES:
            for s, d, n in pieces:
                dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
            return len(pieces)
        # Scattered ids: one gather (and one scatter) kernel instead of a launch per run.
        index = torch.tensor(src_ids, dtype=torch.int64).to(src.device, non_blocking=True)
        d0, n = dst_ids[0], len(dst_ids)
        if dst_ids == list(range(d0, d0 + n)):
            torch.index_select(src, 0, index, out=dst[d0 : d0 + n])
        else:
            where = torch.tensor(dst_ids, dtype=torch.int64).to(dst.device, non_blocking=True)
            dst.index_copy_(0, where, src.index_select(0, index))  # one temporary of the blocks
        return 1
