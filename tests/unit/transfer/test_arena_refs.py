"""Exported arenas and the shared-memory transport's REF frames: bytes that live in an arena
reach the peer by reference (one copy, the receiver's), in order with everything else; a peer
that cannot map the arena gets them through slots; a REF naming memory the receiver did not
map ends the stream instead of reading anything; a worker without memfds keeps its KV on the
heap."""

from __future__ import annotations

import asyncio
import contextlib
import os

import numpy as np
import pytest

from pdserve.engine.kv_cache import KVCache
from pdserve.errors import PeerClosed
from pdserve.transfer import arena, shm
from pdserve.transfer.arena import Arena, ArenaInfo, locate, map_peer
from pdserve.transfer.shm import leaked_segments, open_shm_stream, serve_shm
from pdserve.transfer.slot_stream import SlotStream

MIB = 1 << 20
# One arena for the module (exports last as long as the process, as a worker's KV cache).
ARENA = arena.export(16 * MIB)
SOURCE = np.frombuffer(ARENA.map, dtype=np.uint8)
SOURCE[:] = np.arange(SOURCE.size, dtype=np.uint32).view(np.uint8)[: SOURCE.size] ^ 0x5A


def run(body: object) -> None:
    asyncio.run(asyncio.wait_for(body, 30))  # type: ignore[arg-type]


class _Pair:
    async def __aenter__(self) -> tuple[SlotStream, SlotStream]:
        self.accepted: asyncio.Queue[SlotStream] = asyncio.Queue()
        self.done = asyncio.Event()

        async def handler(stream: SlotStream) -> None:  # type: ignore[override]
            await self.accepted.put(stream)
            await self.done.wait()

        self.server = await serve_shm(handler)  # type: ignore[arg-type]
        self.client = await open_shm_stream(self.server.address)
        return self.client, await self.accepted.get()

    async def __aexit__(self, *exc: object) -> None:
        self.done.set()
        await self.client.aclose()
        await self.server.aclose()


async def _receive(stream: SlotStream, num_bytes: int) -> bytes:
    out = bytearray(num_bytes)
    view = memoryview(out)
    for start in range(0, num_bytes, MIB):  # as the KV receiver lands, piece by piece
        await stream.receive_into(view[start : start + MIB])
    return bytes(out)


def test_arena_bytes_go_by_reference_in_order_with_everything_else() -> None:
    src = memoryview(ARENA.map)
    private = bytes(range(256)) * 4096  # 1 MiB on the heap
    views = [memoryview(b"header--"), src[: 3 * MIB], memoryview(private), src[5 * MIB : 9 * MIB]]
    want = b"".join(bytes(v) for v in views)

    async def body() -> None:
        async with _Pair() as (a, b):
            got, _ = await asyncio.gather(_receive(b, len(want)), a.send(views))
            assert got == want
            assert a.num_ref_bytes == 7 * MIB  # the two arena views, never copied by a
            assert a.num_slot_bytes == 8 + len(private)

    run(body())
    assert leaked_segments() == []


def test_a_peer_that_cannot_map_the_arena_gets_the_bytes_through_slots(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shm.arena, "map_peer", lambda info: None)  # another PID namespace
    src = memoryview(ARENA.map)

    async def body() -> None:
        async with _Pair() as (a, b):
            got, _ = await asyncio.gather(_receive(b, 4 * MIB), a.send([src[: 4 * MIB]]))
            assert got == bytes(src[: 4 * MIB])
            assert a.num_ref_bytes == 0 and a.num_slot_bytes == 4 * MIB

    run(body())


def test_a_ref_to_memory_the_receiver_did_not_map_ends_the_stream() -> None:
    """A buggy or hostile sender names an arena the receiver has not mapped: nothing is read
    from anywhere, the receiver sees the stream end."""

    async def body() -> None:
        async with _Pair() as (a, b):
            b._peer_arenas = [None] * len(b._peer_arenas)  # as if the map had failed
            with pytest.raises(PeerClosed):
                await asyncio.gather(
                    b.receive_into(memoryview(bytearray(MIB))),
                    a.send([memoryview(ARENA.map)[:MIB]]),
                )

    run(body())


def test_locate_finds_views_wholly_inside_an_arena_only() -> None:
    other = Arena(2 * MIB)
    src, heap = memoryview(ARENA.map), memoryview(bytearray(MIB))
    assert locate(src[MIB : 2 * MIB], [other, ARENA]) == (1, MIB)
    assert locate(heap, [other, ARENA]) is None
    assert locate(src[:0], [ARENA]) is None
    assert ARENA.offset_of(memoryview(other.map)) is None
    # A view that starts inside but runs past the end is not inside.
    assert other.offset_of(memoryview(other.map)[MIB:]) == MIB


def test_map_peer_refuses_what_it_cannot_open_or_what_is_too_small() -> None:
    assert map_peer(ArenaInfo(2**31 - 1, 3, MIB)) is None  # no such process
    assert map_peer(ArenaInfo(os.getpid(), ARENA.fd, ARENA.num_bytes + MIB)) is None
    mapped = map_peer(ArenaInfo(os.getpid(), ARENA.fd, ARENA.num_bytes))
    assert mapped is not None and mapped[:16] == ARENA.map[:16]
    mapped.close()


def test_a_kv_cache_without_memfds_stays_on_the_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memfd(num_bytes: int) -> Arena:
        raise OSError(38, "memfd_create: function not implemented")

    monkeypatch.setattr(arena, "export", no_memfd)
    kv = KVCache(4, 2, 16, 2, 8, shared=True)
    assert kv.arena is None and float(kv.tensor.abs().sum()) == 0.0
    kv.block_views([0])[0][:4] = b"\1\2\3\4"  # writable as ever


def test_a_shared_kv_cache_is_in_an_exported_arena_and_starts_zeroed() -> None:
    kv = KVCache(4, 2, 16, 2, 8, shared=True)
    assert kv.arena is not None and kv.arena in arena.exported()
    assert float(kv.tensor.abs().sum()) == 0.0
    (view,) = kv.block_views([2])
    assert locate(view, arena.exported()) is not None


def test_an_arena_whose_owner_is_gone_is_no_longer_exported_and_its_fd_closes() -> None:
    import gc

    kv = KVCache(4, 2, 16, 2, 8, shared=True)
    assert kv.arena is not None
    fd = kv.arena.fd
    del kv
    gc.collect()
    assert all(a.fd != fd or a is ARENA for a in arena.exported())
    # Closed: the number is free, or was reused by something that is not this memfd.
    with contextlib.suppress(FileNotFoundError):
        assert "pdserve-kv" not in os.readlink(f"/proc/self/fd/{fd}")


def test_arena_bytes_changed_after_the_send_fail_the_receivers_checksum() -> None:
    """The receiver reads a REF when it gets to it: a sender that reuses the memory in the
    meantime (its lease ended) is caught by the check of what the receiver copied, as the KV
    receiver checks every Chunk (`framing.read_data_into` against the frame's checksum)."""
    from pdserve.transfer.codec import Envelope, data_checksum
    from pdserve.transfer.framing import read_data_into, read_frame, write_frame
    from pdserve.transfer.messages import Chunk
    from pdserve.transfer.session import Outbound

    src = np.frombuffer(ARENA.map, dtype=np.uint8)
    block = memoryview(ARENA.map)[12 * MIB : 13 * MIB]

    async def body() -> None:
        async with _Pair() as (a, b):
            chunk = Chunk(0, MIB, data_checksum([block]))
            await write_frame(a, Outbound(Envelope(), chunk), [block])
            assert a.num_ref_bytes == MIB  # sent by reference: nothing copied yet
            src[12 * MIB + 7] ^= 0xFF  # the sender reuses the block before b reads it
            header, message = await read_frame(b)
            assert isinstance(message, Chunk)
            landed = memoryview(bytearray(MIB))
            digest = await read_data_into(b, [landed], 5.0)
            assert digest != header.data_checksum  # refused, never trusted
            src[12 * MIB + 7] ^= 0xFF

    run(body())
