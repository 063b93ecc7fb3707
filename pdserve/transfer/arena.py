"""Exported memory: a process's KV cache in a memfd that a same-host peer maps read-only.

The shared-memory transport moves bulk bytes through slots: the sender copies them into the
peer's inbox and the receiver copies them out, two copies. When the bytes already live in an
exported arena (the sending engine's KV cache, `KVCache(shared=True)`), the sender announces
where they are instead (`slot_stream`'s REF frame) and the receiver copies them straight from
its read-only mapping of the arena into their destination: one copy, the receiver's own.

Why reading is safe where writing would not be: the receiver alone writes into its KV blocks,
from the task serving the connection, so fencing a transfer still stops every write (a sender
paused past its lease can write nothing anywhere). The sender's memory is only read: if the
sender reuses a block before the receiver read it (its lease ended), the receiver's checksum
of what it copied differs from the one the sender computed, and the attempt is refused.

An arena is a memfd (no name in /dev/shm, nothing to leak when the process dies); a peer opens
it as /proc/<pid>/fd/<fd>, which needs the same host and PID namespace: where that fails, the
peer says so at the handshake and the slot path is used.

It knows memory and file descriptors; not frames, sessions or engines.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import weakref
from dataclasses import dataclass

import numpy as np

_PAGE_BYTES = mmap.PAGESIZE


@dataclass(frozen=True, slots=True)
class ArenaInfo:
    """What a peer needs to map an arena: the owner's pid, the memfd's number, its size."""

    pid: int
    fd: int
    num_bytes: int


class Arena:
    """One memfd mapped read-write in this process, pre-touched."""

    def __init__(self, num_bytes: int, name: str = "pdserve-kv") -> None:
        if num_bytes < 1:
            raise ValueError(f"Arena: num_bytes must be >= 1, got {num_bytes}")
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, num_bytes)
            self.map = mmap.mmap(self.fd, num_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.close(self.fd)
            raise
        self.num_bytes = num_bytes
        # The memfd lives as long as this object (peers keep their own mappings of it).
        weakref.finalize(self, os.close, self.fd)
        # Write every page once: a first touch during a transfer costs ~10x a memcpy.
        for offset in range(0, num_bytes, _PAGE_BYTES):
            self.map[offset] = 0
        self.base = _address(memoryview(self.map))

    @property
    def info(self) -> ArenaInfo:
        return ArenaInfo(os.getpid(), self.fd, self.num_bytes)

    def offset_of(self, view: memoryview) -> int | None:
        """Where `view` starts in this arena, if it lies entirely inside it."""
        start = _address(view) - self.base
        return start if start >= 0 and start + view.nbytes <= self.num_bytes else None


# Weak: an arena whose owner (a KV cache) is gone is announced to no new peer.
_EXPORTED: weakref.WeakValueDictionary[int, Arena] = weakref.WeakValueDictionary()
_NEXT = itertools.count()


def export(num_bytes: int) -> Arena:
    """A new arena that this process's shm streams may hand to peers by reference (for as
    long as the caller keeps it)."""
    arena = Arena(num_bytes)
    _EXPORTED[next(_NEXT)] = arena
    return arena


def exported() -> list[Arena]:
    """The live arenas exported by this process, oldest first (a stream numbers them in this
    order at its handshake and keeps them while it lives)."""
    return [arena for _, arena in sorted(_EXPORTED.items())]


def locate(view: memoryview, arenas: list[Arena]) -> tuple[int, int] | None:
    """(index in `arenas`, offset) of the arena holding all of `view`, or None."""
    if view.nbytes == 0:
        return None
    for i, arena in enumerate(arenas):
        offset = arena.offset_of(view)
        if offset is not None:
            return i, offset
    return None


def map_peer(info: ArenaInfo) -> mmap.mmap | None:
    """A read-only mapping of a peer's arena, or None where it cannot be opened here."""
    try:
        fd = os.open(f"/proc/{info.pid}/fd/{info.fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size < info.num_bytes:
            return None
        # MAP_POPULATE: page tables built now, not by a fault per page during a transfer.
        flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
        return mmap.mmap(fd, info.num_bytes, flags=flags, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _address(view: memoryview) -> int:
    # numpy reads the address of read-only buffers too (ctypes needs a writable one).
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
