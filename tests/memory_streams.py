"""In-memory `ByteStream` pairs for tests: both ends in one event loop, bounded buffering.

Each direction is a `_Pipe`: a queue of memoryview segments. A send queues views of the
caller's buffers without copying, and the receiver copies straight from them into its own
view (one memcpy, like a kernel socket). Backpressure: `send` returns only once at most
`capacity_bytes` of the stream are unread, and before returning it copies that unread tail of
its own views into owned bytes, so the caller may reuse its buffers as soon as `send` returns.

A cancelled send withdraws its unread segments; if the peer had already read part of them, the
send direction is broken (the peer saw a prefix). Closing one end gives the peer EOF after the
bytes already sent, and makes the peer's later sends raise `PeerClosed`.

This module knows nothing of frames or sockets.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence

from pdserve.errors import PeerClosed
from pdserve.transfer.stream import (
    DEFAULT_RECEIVE_BYTES,
    Buffer,
    ByteStream,
    DirectionState,
    byte_views,
    check_max_bytes,
    writable_view,
)

DEFAULT_CAPACITY_BYTES = 1 << 20


class _Pipe:
    """One direction of a pair: segments queued by the writer, consumed by the reader."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.segments: deque[memoryview] = deque()
        self.num_buffered = 0
        # The last `num_borrowed` segments are views of the in-flight send's caller buffers.
        self.num_borrowed = 0
        self.writer_closed = False
        self.reader_closed = False
        self.data = asyncio.Event()
        self.space = asyncio.Event()

    def read_into(self, dst: memoryview) -> int:
        """Copy up to len(dst) queued bytes into dst; return how many."""
        num_copied = 0
        while self.segments and num_copied < dst.nbytes:
            seg = self.segments[0]
            n = min(seg.nbytes, dst.nbytes - num_copied)
            dst[num_copied : num_copied + n] = seg[:n]
            num_copied += n
            if n == seg.nbytes:
                self.segments.popleft()
            else:
                self.segments[0] = seg[n:]
        self.num_buffered -= num_copied
        self.num_borrowed = min(self.num_borrowed, len(self.segments))
        self.space.set()
        return num_copied

    def withdraw_borrowed(self) -> int:
        """Remove the in-flight send's unread segments; return how many bytes they held."""
        num_bytes = 0
        for _ in range(self.num_borrowed):
            num_bytes += self.segments.pop().nbytes
        self.num_buffered -= num_bytes
        self.num_borrowed = 0
        return num_bytes

    def own_borrowed(self) -> None:
        """Copy the in-flight send's unread segments so its caller may reuse its buffers."""
        for i in range(len(self.segments) - self.num_borrowed, len(self.segments)):
            self.segments[i] = memoryview(bytes(self.segments[i]))
        self.num_borrowed = 0


class MemoryStream(ByteStream):
    """One end of an in-memory pair; see `memory_stream_pair`."""

    def __init__(self, outgoing: _Pipe, incoming: _Pipe, name: str) -> None:
        self._out = outgoing
        self._in = incoming
        self._name = name
        self._send_lock = asyncio.Lock()
        self._receive_lock = asyncio.Lock()
        self._send_state = DirectionState(f"memory {name} send")
        self._receive_state = DirectionState(f"memory {name} receive")

    async def send(self, buffers: Sequence[Buffer]) -> None:
        """Queue views of `buffers`; return once the unread tail fits the capacity."""
        views = byte_views(buffers)
        async with self._send_lock:
            self._send_state.check()
            pipe = self._out
            if pipe.reader_closed:
                raise PeerClosed(f"memory {self._name}: peer closed its end")
            if not views:
                return
            num_total = sum(v.nbytes for v in views)
            pipe.segments.extend(views)
            pipe.num_buffered += num_total
            pipe.num_borrowed = len(views)
            pipe.data.set()
            try:
                while pipe.num_buffered > pipe.capacity_bytes:
                    self._send_state.check()
                    if pipe.reader_closed:
                        raise PeerClosed(f"memory {self._name}: peer closed during send")
                    pipe.space.clear()
                    await pipe.space.wait()
            except BaseException as exc:
                num_unread = pipe.withdraw_borrowed()
                if isinstance(exc, asyncio.CancelledError) and num_unread < num_total:
                    self._send_state.break_(
                        f"send cancelled after {num_total - num_unread} of {num_total} bytes"
                    )
                raise
            pipe.own_borrowed()

    async def receive_into(self, view: memoryview) -> None:
        """Copy exactly len(view) bytes from the peer's sends into `view`."""
        target = writable_view(view)
        async with self._receive_lock:
            self._receive_state.check()
            num_received = 0
            try:
                while num_received < target.nbytes:
                    await self._wait_data()
                    if not self._in.segments:
                        raise PeerClosed(
                            f"memory {self._name}: stream ended after {num_received} of "
                            f"{target.nbytes} bytes"
                        )
                    num_received += self._in.read_into(target[num_received:])
            except asyncio.CancelledError:
                if num_received:
                    self._receive_state.break_(f"receive cancelled after {num_received} bytes")
                raise

    async def receive_some(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        """Up to `max_bytes` of what is queued (waiting for some); b"" at end of stream."""
        check_max_bytes(max_bytes)
        async with self._receive_lock:
            self._receive_state.check()
            await self._wait_data()
            out = bytearray(min(max_bytes, self._in.num_buffered))
            n = self._in.read_into(memoryview(out))
            return bytes(out[:n])

    async def aclose(self) -> None:
        """Give the peer EOF, refuse its further sends, wake local waiters (idempotent)."""
        self._send_state.break_("closed locally")
        self._receive_state.break_("closed locally")
        self._out.writer_closed = True
        self._out.data.set()
        self._out.space.set()
        self._in.reader_closed = True
        self._in.segments.clear()
        self._in.num_buffered = 0
        self._in.num_borrowed = 0
        self._in.space.set()
        self._in.data.set()

    async def _wait_data(self) -> None:
        """Wait until bytes are queued or the writer closed; raise if this end closed."""
        while not self._in.segments and not self._in.writer_closed:
            self._receive_state.check()
            self._in.data.clear()
            await self._in.data.wait()
        self._receive_state.check()


def memory_stream_pair(
    capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
) -> tuple[MemoryStream, MemoryStream]:
    """Two connected in-memory streams; each direction buffers at most `capacity_bytes`."""
    if capacity_bytes < 0:
        raise ValueError(f"memory_stream_pair: capacity_bytes must be >= 0, got {capacity_bytes}")
    a_to_b = _Pipe(capacity_bytes)
    b_to_a = _Pipe(capacity_bytes)
    return MemoryStream(a_to_b, b_to_a, "a"), MemoryStream(b_to_a, a_to_b, "b")
