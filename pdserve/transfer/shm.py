"""Same-host `ByteStream`: control over TCP loopback, bulk bytes through shared memory.

Each end creates an inbox: a file in /dev/shm cut into `num_slots` slots of `slot_bytes`,
pre-touched at creation (a first touch of fresh pages costs ~10x a memcpy). The peer maps it as
its outbox; a send memcpys the caller's views into a free slot of the peer's inbox and announces
it with a 12-byte DATA frame; the receiver memcpys from the slot into the caller's view and
returns the credit (see `slot_stream` for the protocol). Two copies, no sockets for bulk bytes.

Handshake (symmetric, over the control stream):
    HELLO(magic, version, num_slots, slot_bytes, inbox name) → map the peer's inbox
    → ATTACHED → on the peer's ATTACHED, unlink the own inbox file
    → ARENAS(each exported arena: pid, fd, size) → map the peer's, read-only, where possible
    → MAPPED(one byte per peer arena: 1 if mapped) → the peer sends those by reference.
So no /dev/shm name outlives the handshake: a process that dies later leaks nothing, and the
mappings vanish with the last process holding them (arenas are memfds, never named). A failed
handshake unlinks at once.

Bytes that lie in an exported arena (a prefill engine's KV cache, `transfer/arena.py`) travel
by reference: the receiver copies them straight out of its mapping of the sender's arena, one
copy instead of two; everything else goes through slots.

This module knows segments, slots and the handshake, not the KV codec or sessions.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
import struct
from dataclasses import dataclass

from pdserve.errors import BadMagic, ProtocolError, UnsupportedVersion
from pdserve.transfer import arena
from pdserve.transfer.slot_stream import SlotStream, SlotWrite
from pdserve.transfer.stream import ByteStream
from pdserve.transfer.tcp import Upgraded

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "pdserve-shm-"
_NAME_RE = re.compile(r"pdserve-shm-[0-9]+-[0-9a-f]{16}")
_HELLO = struct.Struct("<4sHHIQH")  # magic, version, reserved, num_slots, slot_bytes, name length
_MAGIC = b"PDSM"
_VERSION = 2
# Segment names are short ("pdserve-kv-..."); a longer one is refused unread.
_MAX_NAME_BYTES = 255
_ARENA_COUNT = struct.Struct("<H")
_ARENA = struct.Struct("<IIQ")  # pid, fd, num_bytes
# Arenas one side may announce (a process exports one per engine).
MAX_ARENAS = 16
_ATTACHED = b"A"
_PAGE_BYTES = mmap.PAGESIZE


@dataclass(frozen=True, slots=True)
class ShmConfig:
    """Geometry of the inbox each end creates."""

    num_slots: int = 8
    slot_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        if self.num_slots < 1 or self.slot_bytes < 1:
            raise ValueError(f"ShmConfig: need num_slots, slot_bytes >= 1, got {self}")


class _Segment:
    """One mapped /dev/shm file; `unlink` removes the name, `close` the mapping."""

    def __init__(self, name: str, num_bytes: int, create: bool) -> None:
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        self._linked = create
        try:
            if create:
                os.ftruncate(fd, num_bytes)
            elif os.fstat(fd).st_size < num_bytes:
                raise ProtocolError(f"shm segment {name} is smaller than the {num_bytes} announced")
            # MAP_POPULATE builds the page tables now rather than on first touch.
            self.map = mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        if create:
            # Write every page once so its first touch is not paid during a transfer.
            for offset in range(0, num_bytes, _PAGE_BYTES):
                self.map[offset] = 0

    def unlink(self) -> None:
        if self._linked:
            self._linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def close(self) -> None:
        self.unlink()
        # A view still alive somewhere keeps the mapping until it goes.
        with contextlib.suppress(BufferError):
            self.map.close()


class _ShmWriter:
    """Writes into the peer's inbox by memcpy through our mapping of it."""

    def __init__(self, outbox: _Segment, slot_bytes: int) -> None:
        self._outbox = outbox
        self._view = memoryview(outbox.map)
        self._slot_bytes = slot_bytes

    async def write(self, job: SlotWrite) -> None:
        # A memcpy: done on return, nothing for the peer to drive (never announced).
        offset = job.slot * self._slot_bytes
        for view in job.views:
            self._view[offset : offset + view.nbytes] = view
            offset += view.nbytes

    def close(self) -> None:
        self._view.release()
        self._outbox.close()


async def connect_shm(control: ByteStream, config: ShmConfig | None = None) -> SlotStream:
    """Run the shm handshake over an open control stream and return the shm stream.

    Both ends call this (it is symmetric); on failure the control stream is left to the caller.
    """
    config = config or ShmConfig()
    name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    inbox = _Segment(name, config.num_slots * config.slot_bytes, create=True)
    outbox: _Segment | None = None
    try:
        encoded = name.encode()
        hello = _HELLO.pack(_MAGIC, _VERSION, 0, config.num_slots, config.slot_bytes, len(encoded))
        await control.send([hello, encoded])
        header = bytearray(_HELLO.size)
        await control.receive_into(memoryview(header))
        magic, version, _, peer_num_slots, peer_slot_bytes, name_len = _HELLO.unpack(header)
        if magic != _MAGIC:
            raise BadMagic(f"shm handshake: magic {magic!r}, expected {_MAGIC!r}")
        if version != _VERSION:
            raise UnsupportedVersion(
                f"shm handshake: version {version}, this build speaks {_VERSION}"
            )
        if name_len > _MAX_NAME_BYTES:
            # Checked before reading: the handshake runs before any cluster MAC.
            raise ProtocolError(
                f"shm handshake: segment name of {name_len} bytes, at most {_MAX_NAME_BYTES}"
            )
        peer_name = bytearray(name_len)
        await control.receive_into(memoryview(peer_name))
        if not _NAME_RE.fullmatch(peer_name.decode(errors="replace")):
            raise ProtocolError(f"shm handshake: bad segment name {bytes(peer_name)!r}")
        outbox = _Segment(peer_name.decode(), peer_num_slots * peer_slot_bytes, create=False)
        await control.send([_ATTACHED])
        ack = bytearray(1)
        await control.receive_into(memoryview(ack))
        if ack != _ATTACHED:
            raise ProtocolError(f"shm handshake: expected ATTACHED, got {bytes(ack)!r}")
        inbox.unlink()
        exported, peer_maps = await _exchange_arenas(control)
    except BaseException:
        inbox.close()
        if outbox is not None:
            outbox.close()
        raise

    def close() -> None:
        inbox.close()
        _close_maps(peer_maps)

    return SlotStream(
        control,
        inbox=memoryview(inbox.map),
        inbox_slot_bytes=config.slot_bytes,
        writer=_ShmWriter(outbox, peer_slot_bytes),
        peer_num_slots=peer_num_slots,
        peer_slot_bytes=peer_slot_bytes,
        on_close=close,
        name=f"shm {name}",
        exported=exported,
        peer_arenas=[memoryview(m) if m is not None else None for m in peer_maps],
    )


async def _exchange_arenas(
    control: ByteStream,
) -> tuple[list[arena.Arena | None], list[mmap.mmap | None]]:
    """ARENAS and MAPPED both ways: our arenas the peer mapped (None where it could not), and
    the peer's arenas as mapped here (None where they could not be)."""
    mine = arena.exported()[:MAX_ARENAS]
    table = [_ARENA_COUNT.pack(len(mine)), *(_ARENA.pack(*_info(a)) for a in mine)]
    await control.send(table)
    count = bytearray(_ARENA_COUNT.size)
    await control.receive_into(memoryview(count))
    (num_peer,) = _ARENA_COUNT.unpack(count)
    if num_peer > MAX_ARENAS:
        raise ProtocolError(f"shm handshake: {num_peer} arenas announced, at most {MAX_ARENAS}")
    peer_maps: list[mmap.mmap | None] = []
    try:
        for _ in range(num_peer):
            raw = bytearray(_ARENA.size)
            await control.receive_into(memoryview(raw))
            pid, fd, num_bytes = _ARENA.unpack(raw)
            peer_maps.append(arena.map_peer(arena.ArenaInfo(pid, fd, num_bytes)))
        if peer_maps:
            await control.send([bytes(m is not None for m in peer_maps)])
        mapped = bytearray(len(mine))
        if mine:
            await control.receive_into(memoryview(mapped))
    except BaseException:
        _close_maps(peer_maps)
        raise
    if any(flag > 1 for flag in mapped):
        raise ProtocolError(f"shm handshake: bad MAPPED flags {bytes(mapped)!r}")
    if not all(mapped):
        # Not an error (the bytes go through slots, two copies), but never silent.
        log.info("shm peer mapped %d of this process's %d KV arenas", sum(mapped), len(mine))
    return [a if mapped[i] else None for i, a in enumerate(mine)], peer_maps


def _close_maps(maps: list[mmap.mmap | None]) -> None:
    for m in maps:
        if m is not None:
            # A view still alive somewhere keeps the mapping until it goes.
            with contextlib.suppress(BufferError):
                m.close()


def _info(a: arena.Arena) -> tuple[int, int, int]:
    info = a.info
    return info.pid, info.fd, info.num_bytes


# Over a TCP control stream that `connect_shm` sets the transport up on.
_SHM = Upgraded(connect_shm)
open_shm_stream = _SHM.open
serve_shm = _SHM.serve


def leaked_segments() -> list[str]:
    """Names of pdserve shm files present in /dev/shm (tests assert none are left)."""
    with contextlib.suppress(FileNotFoundError):
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(SEGMENT_PREFIX))
    return []


ShmStream = SlotStream
"""The stream type `open_shm_stream` returns (named for symmetry with the other transports)."""
