"""A `ByteStream` whose bulk bytes go through the receiver's slot pool ("inbox").

Shared by the shared-memory and NIXL transports, which differ only in how bytes reach a slot of
the peer's inbox (a memcpy into a mapped segment, or a NIXL WRITE): that is the `SlotWriter`.

Protocol on the control stream (a TCP connection), one 12-byte frame per message:

    DATA(slot, num_bytes)     sender → receiver: slot `slot` of your inbox holds the next bytes
    INLINE(slot, num_bytes)   sender → receiver: the next bytes follow this frame on the control
                              stream itself (a send of at most `INLINE_MAX_BYTES`); it holds
                              the credit of `slot`, whose memory it does not touch
    CREDIT(slot)              receiver → sender: slot `slot` is free again
    WRITING(slot, num_bytes)  sender → receiver, optional: a write into `slot` is under way and
                              needs the receiver to drive progress until its DATA (transports
                              whose one-sided writes may need the target, e.g. UCX over TCP)
    REF(arena, num_bytes) + offset (u64)
                              sender → receiver: the next bytes are at `offset` of the sender's
                              exported arena `arena` (`transfer/arena.py`), which the receiver
                              mapped read-only at the handshake; no slot, no credit, and the
                              receiver's copy out of the arena is the only copy

Small sends (the protocol's Hello, Begin, Commit and their replies) go INLINE: one frame and
their bytes on the socket, instead of a slot write plus its announcement; for NIXL that saves a
memory registration and a one-sided write per message. Bulk bytes go through slots.

Credit-based flow control: a sender owns the slots it holds credit for (all of them at the
start) and writes only into those; every DATA and INLINE uses one credit, so at most
`num_slots` sends are queued unread at the receiver, in its inbox or in INLINE buffers. The
receiver copies each out into the caller's view and then returns the credit. Since the receiver
owns its inbox memory (and its INLINE buffers), bytes already announced stay readable after the
peer exits; EOF comes after them, in order, as the control stream's EOF.

Only memory whose changes the layer above would detect is sent by REF: the receiver reads it
after `send` returned, so the bytes it gets are those of the moment it copies (the KV layer
checksums every chunk before sending it and the receiver checks what it copied).

Invariants: a slot is written only while the sender holds its credit; frames (an INLINE frame
with its bytes) are sent whole (shielded from cancellation) so the control stream never carries
half a frame; a background task demultiplexes incoming frames, so credits flow even while
nobody receives.

This module knows slots and frames of its own, never the KV codec above it.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.errors import PeerClosed, ProtocolError, TransferError
from pdserve.tasks import cancel_and_wait
from pdserve.transfer.arena import Arena, locate
from pdserve.transfer.stream import (
    DEFAULT_RECEIVE_BYTES,
    Buffer,
    ByteStream,
    DirectedStream,
    byte_views,
    check_max_bytes,
    close_both,
)

_FRAME = struct.Struct("<BxxxII")  # kind, slot index, num_bytes
_DATA = 1
_CREDIT = 2
_WRITING = 3
_INLINE = 4
_REF = 5
_REF_OFFSET = struct.Struct("<Q")
# A REF's bytes hold no slot: nothing to give back once they are read.
_NO_CREDIT = -1
# One REF frame covers at most this many bytes (its length field is 32 bits).
_REF_MAX_BYTES = 1 << 30
# Sends up to this size travel INLINE on the control stream (one frame header's worth of
# protocol message is ~100-300 bytes; a KV chunk's data is megabytes).
INLINE_MAX_BYTES = 64 << 10

Announce = Callable[[], Awaitable[None]]
"""Sends the WRITING frame of the write in progress (at most once per write)."""


@dataclass(frozen=True, slots=True)
class SlotWrite:
    """One write into the peer's inbox: `views` (together at most one slot) go to the start of
    `slot`; `peer_gone` and `announce` are the stream's, for a writer that must wait."""

    slot: int
    views: list[memoryview]
    peer_gone: Callable[[], bool]
    announce: Announce


class SlotWriter(Protocol):
    """Puts bytes into one slot of the peer's inbox."""

    async def write(self, job: SlotWrite) -> None:
        """Copy `job.views` to the start of `job.slot`.

        On return, including by cancellation, no write into the slot may still be in flight.
        A writer that waits for its write to complete awaits `job.announce()` first (the peer
        then drives its progress until the DATA), polls `job.peer_gone` and raises `PeerClosed`
        once it is true.
        """
        ...

    def close(self) -> None:
        """Release what the writer holds (mappings, registrations)."""
        ...


def _chunks(views: list[memoryview], chunk_bytes: int) -> Iterator[list[memoryview]]:
    """Split `views` into consecutive groups of at most `chunk_bytes` (slicing, never copying)."""
    group: list[memoryview] = []
    room = chunk_bytes
    for view in views:
        while view.nbytes:
            piece = view[:room]
            group.append(piece)
            room -= piece.nbytes
            view = view[piece.nbytes :]
            if room == 0:
                yield group
                group, room = [], chunk_bytes
    if group:
        yield group


class _Unread:
    """Announced bytes not yet read: a slot of the inbox, or an INLINE buffer holding a
    slot's credit."""

    __slots__ = ("offset", "slot", "source")

    def __init__(self, slot: int, source: memoryview) -> None:
        self.slot = slot
        self.source = source
        self.offset = 0


class SlotStream(DirectedStream):
    """A `ByteStream` over a control stream plus an inbox slot pool on each side."""

    def __init__(
        self,
        control: ByteStream,
        inbox: memoryview,
        inbox_slot_bytes: int,
        writer: SlotWriter,
        peer_num_slots: int,
        peer_slot_bytes: int,
        on_close: Callable[[], None],
        name: str,
        on_peer_writing: Callable[[bool], None] | None = None,
        exported: Sequence[Arena | None] = (),
        peer_arenas: Sequence[memoryview | None] = (),
    ) -> None:
        """`on_peer_writing(True)` runs on each WRITING frame, `(False)` on each DATA frame.
        `exported[i]`: this process's arena i, where the peer mapped it (None: it could not),
        sent by REF; `peer_arenas[i]`: the peer's arena i as mapped here (None: not mapped)."""
        self._control = control
        self._inbox = inbox
        self._slot_bytes = inbox_slot_bytes
        self._num_slots = inbox.nbytes // inbox_slot_bytes
        self._writer = writer
        self._peer_slot_bytes = peer_slot_bytes
        self._on_close = on_close
        self._on_peer_writing = on_peer_writing
        self._free_slots: deque[int] = deque(range(peer_num_slots))
        self._pending: deque[_Unread] = deque()  # announced by DATA or INLINE, in order
        self._current: _Unread | None = None
        self._eof = False
        self._credit = asyncio.Event()
        self._data = asyncio.Event()
        super().__init__(name)
        self._closed = False
        # The arenas the peer mapped (a REF names one by its index in `exported`).
        self._ref_arenas = [a for a in exported if a is not None]
        self._ref_ids = [i for i, a in enumerate(exported) if a is not None]
        self._peer_arenas = list(peer_arenas)
        # Bytes sent by reference (REF) and through slots (DATA, INLINE), for tests and stats.
        self.num_ref_bytes = 0
        self.num_slot_bytes = 0
        self._reader = asyncio.get_running_loop().create_task(self._read_control())

    async def send(self, buffers: Sequence[Buffer]) -> None:
        """Write `buffers` slot by slot into the peer's inbox, announcing each with DATA; a
        small send goes INLINE instead."""
        views = byte_views(buffers)
        num_total = sum(v.nbytes for v in views)
        async with self._send_lock:
            self._send_state.check()
            if not views:
                return
            if num_total <= min(INLINE_MAX_BYTES, self._peer_slot_bytes):
                slot = await self._acquire_slot()
                # One small copy, so the shielded write below never reads the caller's
                # buffers after a cancellation has handed them back.
                payload = b"".join(views)
                await self._send_frame(_INLINE, slot, num_total, payload)
                return
            num_announced = 0
            try:
                for ref, run in self._runs(views):
                    if ref is not None:
                        arena_id, offset = ref
                        for start in range(0, run[0].nbytes, _REF_MAX_BYTES):
                            num_bytes = min(_REF_MAX_BYTES, run[0].nbytes - start)
                            if self._eof:
                                raise PeerClosed(f"{self._name}: peer closed its end")
                            at = _REF_OFFSET.pack(offset + start)
                            await self._send_frame(_REF, arena_id, num_bytes, at)
                            num_announced += num_bytes
                            self.num_ref_bytes += num_bytes
                        continue
                    for chunk in _chunks(run, self._peer_slot_bytes):
                        num_announced += await self._send_slot(chunk)
            except asyncio.CancelledError:
                if num_announced:
                    self._send_state.break_(f"send cancelled after {num_announced} bytes")
                raise

    def _runs(
        self, views: list[memoryview]
    ) -> Iterator[tuple[tuple[int, int] | None, list[memoryview]]]:
        """`views` in order as runs: ((arena id, offset), [one view]) for a view the peer can
        read by reference, (None, [views]) for consecutive ones that go through slots."""
        run: list[memoryview] = []
        for view in views:
            found = locate(view, self._ref_arenas) if self._ref_arenas else None
            if found is None:
                run.append(view)
                continue
            if run:
                yield None, run
                run = []
            yield (self._ref_ids[found[0]], found[1]), [view]
        if run:
            yield None, run

    async def _send_slot(self, chunk: list[memoryview]) -> int:
        """Write one slot's worth into the peer's inbox and announce it; its bytes."""
        slot = await self._acquire_slot()
        num_bytes = sum(v.nbytes for v in chunk)
        announced = False

        async def announce() -> None:
            nonlocal announced
            if not announced:
                announced = True
                await self._send_frame(_WRITING, slot, num_bytes)

        try:
            await self._writer.write(SlotWrite(slot, chunk, self._peer_gone, announce))
        except BaseException:
            self._free_slots.appendleft(slot)  # the peer never heard of it
            raise
        await self._send_frame(_DATA, slot, num_bytes)
        self.num_slot_bytes += num_bytes
        return num_bytes

    async def _read_into(self, piece: memoryview) -> int:
        """Bytes of the current slot copied into `piece` (0: end of stream), its credit
        returned once the slot is drained."""
        if not await self._wait_data():
            return 0
        n, drained = self._copy_out(piece)
        if drained is not None and drained != _NO_CREDIT:
            await self._return_credit(drained)
        return n

    async def receive_some(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        """Up to `max_bytes` from the current slot; b"" at end of stream."""
        check_max_bytes(max_bytes)
        async with self._receive_lock:
            self._receive_state.check()
            if not await self._wait_data():
                return b""
            assert self._current is not None
            current = self._current
            out = bytearray(min(max_bytes, current.source.nbytes - current.offset))
            await self._read_into(memoryview(out))
            return bytes(out)

    async def aclose(self) -> None:
        """Stop the control reader, close control (peer sees EOF), release slots (idempotent)."""
        if self._closed:
            return
        self._closed = True
        close_both(self._send_state, self._receive_state)
        self._credit.set()
        self._data.set()
        await cancel_and_wait(self._reader)
        # Drop the views of unread bytes before the inbox and peer arenas they point into are
        # released (a mapping with a live view cannot be closed).
        self._pending.clear()
        self._current = None
        for view in self._peer_arenas:
            if view is not None:
                view.release()
        try:
            await self._control.aclose()
        finally:
            self._writer.close()
            self._inbox.release()
            self._on_close()

    def reusable(self) -> bool:
        """Open both ways, the peer still connected, and nothing announced left unread."""
        return not (
            self._closed
            or self._eof
            or self._pending
            or self._current is not None
            or self._send_state.reason
            or self._receive_state.reason
        )

    async def _acquire_slot(self) -> int:
        while True:
            self._send_state.check()
            if self._eof:
                raise PeerClosed(f"{self._name}: peer closed its end")
            if self._free_slots:
                return self._free_slots.popleft()
            self._credit.clear()
            await self._credit.wait()

    def _peer_gone(self) -> bool:
        return self._eof or self._closed

    async def _wait_data(self) -> bool:
        """Wait until a slot has unread bytes (True) or the peer closed with none left (False)."""
        while self._current is None:
            self._receive_state.check()
            if self._pending:
                self._current = self._pending.popleft()
            elif self._eof:
                return False
            else:
                self._data.clear()
                await self._data.wait()
        return True

    def _copy_out(self, dst: memoryview) -> tuple[int, int | None]:
        """Copy from the current segment into dst: (bytes copied, its slot if now drained)."""
        current = self._current
        assert current is not None
        n = min(dst.nbytes, current.source.nbytes - current.offset)
        dst[:n] = current.source[current.offset : current.offset + n]
        current.offset += n
        if current.offset < current.source.nbytes:
            return n, None
        self._current = None
        return n, current.slot

    async def _return_credit(self, slot: int) -> None:
        # The sender may be gone; bytes already copied stay valid, so ignore that here.
        with contextlib.suppress(TransferError):
            await self._send_frame(_CREDIT, slot, 0)

    async def _send_frame(self, kind: int, slot: int, num_bytes: int, payload: bytes = b"") -> None:
        # Shielded: a cancelled caller must not leave half a frame on the control stream.
        frame = _FRAME.pack(kind, slot, num_bytes)
        await asyncio.shield(self._control.send([frame, payload] if payload else [frame]))

    def _ref_source(self, arena_id: int, offset: int, num_bytes: int) -> memoryview:
        """The bytes a REF names in the peer's arena; ProtocolError if it names none."""
        source = self._peer_arenas[arena_id] if arena_id < len(self._peer_arenas) else None
        if source is None or num_bytes == 0 or offset + num_bytes > source.nbytes:
            raise ProtocolError(
                f"{self._name}: REF of {num_bytes} bytes at {offset} in arena {arena_id},"
                " which is not mapped here or is smaller"
            )
        return source[offset : offset + num_bytes]

    async def _read_control(self) -> None:
        """Demultiplex DATA and CREDIT frames until the control stream ends."""
        frame = bytearray(_FRAME.size)
        try:
            while True:
                await self._control.receive_into(memoryview(frame))
                kind, slot, num_bytes = _FRAME.unpack(frame)
                valid = slot < self._num_slots and num_bytes <= self._slot_bytes
                if kind == _DATA and valid:
                    start = slot * self._slot_bytes
                    self._pending.append(_Unread(slot, self._inbox[start : start + num_bytes]))
                    self._data.set()
                    if self._on_peer_writing is not None:
                        self._on_peer_writing(False)
                elif kind == _INLINE and valid and 0 < num_bytes <= INLINE_MAX_BYTES:
                    payload = bytearray(num_bytes)
                    await self._control.receive_into(memoryview(payload))
                    self._pending.append(_Unread(slot, memoryview(payload)))
                    self._data.set()
                elif kind == _REF:
                    raw = bytearray(_REF_OFFSET.size)
                    await self._control.receive_into(memoryview(raw))
                    (offset,) = _REF_OFFSET.unpack(raw)
                    self._pending.append(
                        _Unread(_NO_CREDIT, self._ref_source(slot, offset, num_bytes))
                    )
                    self._data.set()
                elif kind == _WRITING and valid:
                    if self._on_peer_writing is not None:
                        self._on_peer_writing(True)
                elif kind == _CREDIT and slot not in self._free_slots:
                    self._free_slots.append(slot)
                    self._credit.set()
                else:
                    raise ProtocolError(
                        f"{self._name}: bad control frame kind={kind} slot={slot} "
                        f"num_bytes={num_bytes}"
                    )
        except TransferError:
            pass  # EOF, reset or a bad frame: the peer is gone for this stream either way
        finally:
            self._eof = True
            self._credit.set()
            self._data.set()
