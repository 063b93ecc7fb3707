"""The byte-stream interface every KV data-plane transport implements.

A `ByteStream` is one end of a reliable, ordered, bidirectional byte pipe (TCP semantics):
message boundaries are not kept, so a receiver may see one send split over several receives or
several sends joined in one. Framing belongs to the wire codec above; this module knows nothing
of frames, blocks or sessions.

Rules every implementation keeps (the conformance suite checks each one):

- `send` is a gather-write of several buffers. Large payloads (memoryviews over KV memory,
  numpy arrays, torch tensors) are handed to the kernel / copy engine as views; Python never
  builds one joined `bytes` of the payload.
- `receive_into(view)` fills exactly `len(view)` bytes straight into the caller's memory and
  raises `PeerClosed` if the stream ends first. `receive_some` returns b"" only at end of stream.
- Sends are serialised with each other, and so are receives; one task may send while another
  receives.
- Deadlines are the caller's (`asyncio.timeout`). A cancelled operation that moved no bytes
  leaves the stream usable; one cancelled half-way leaves that direction broken
  (`StreamBroken` on the next call), and `aclose` always completes.
- `aclose` is idempotent. The peer then sees end of stream; operations on the closed end raise
  `StreamBroken`, and tasks blocked on it are woken with `StreamBroken`.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from pdserve.errors import PeerClosed, StreamBroken, TransferError

logger = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview
"""What `send` accepts: anything exporting a C-contiguous buffer, given as bytes or a view."""

Address = tuple[str, int]
"""A listening endpoint: (host, port). Tests use 127.0.0.1 and port 0."""

DEFAULT_RECEIVE_BYTES = 65536


class ByteStream(abc.ABC):
    """One end of a reliable ordered byte stream; see the module docstring for the rules."""

    @abc.abstractmethod
    async def send(self, buffers: Sequence[Buffer]) -> None:
        """Write every byte of `buffers`, in order, without joining them into one object."""

    @abc.abstractmethod
    async def receive_into(self, view: memoryview) -> None:
        """Fill all of `view`; raise `PeerClosed` if the stream ends first."""

    @abc.abstractmethod
    async def receive_some(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        """Return between 1 and `max_bytes` bytes as soon as any arrive; b"" at end of stream."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close this end (idempotent); wake local waiters; the peer sees end of stream."""

    def reusable(self) -> bool:
        """Whether an idle stream can carry another exchange: open both ways, nothing unread
        and no end of stream seen. Transports that cannot tell say False (never reused)."""
        return False

    async def __aenter__(self) -> ByteStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


StreamHandler = Callable[[ByteStream], Awaitable[None]]
"""Called by a server once per accepted connection; the server closes the stream after it."""


async def serve_stream(handler: StreamHandler, stream: ByteStream, transport: str) -> None:
    """Run `handler` on one accepted stream, log how it ended, then close the stream."""
    try:
        await handler(stream)
    except TransferError as exc:
        logger.info("%s handler ended: %s", transport, exc)
    except Exception:
        # A failing handler ends its own connection, never the server.
        logger.exception("%s handler failed", transport)
    finally:
        await stream.aclose()


class Server(Protocol):
    """A listening transport endpoint; `aclose` stops accepting and ends running handlers."""

    @property
    def address(self) -> Address: ...

    async def aclose(self) -> None: ...


def byte_view(buffer: Buffer) -> memoryview:
    """A flat unsigned-byte view of `buffer` without copying (numpy/torch views included).

    Raises ValueError for non-contiguous memory: a gather-write of strided memory would need a
    hidden copy, which the caller should make (or avoid) knowingly.
    """
    view = buffer if isinstance(buffer, memoryview) else memoryview(buffer)
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise ValueError("send() needs C-contiguous buffers; got a strided view")
    return view.cast("B")


def byte_views(buffers: Sequence[Buffer]) -> list[memoryview]:
    """`byte_view` of each non-empty buffer, in order."""
    views = [byte_view(b) for b in buffers]
    return [v for v in views if v.nbytes]


def writable_view(view: memoryview) -> memoryview:
    """A flat writable byte view of a `receive_into` destination (checked up front)."""
    if view.readonly:
        raise ValueError("receive_into() needs a writable view")
    return byte_view(view)


def check_max_bytes(max_bytes: int) -> None:
    """Reject a `receive_some` bound below 1 (it could never make progress)."""
    if max_bytes < 1:
        raise ValueError(f"receive_some: max_bytes must be >= 1, got {max_bytes}")


class DirectionState:
    """Open / broken bookkeeping for one direction of a stream, shared by the transports.

    A direction breaks when the local end closes or when an operation is cancelled after moving
    some bytes (the peer's view of the byte sequence is then unknown).
    """

    __slots__ = ("name", "reason")

    def __init__(self, name: str) -> None:
        self.name = name
        self.reason: str | None = None

    def check(self) -> None:
        """Raise `StreamBroken` if this direction can no longer be used."""
        if self.reason is not None:
            raise StreamBroken(f"{self.name}: {self.reason}")

    def break_(self, reason: str) -> None:
        """Mark the direction unusable; the first reason is kept."""
        if self.reason is None:
            self.reason = reason

    async def fill(
        self, target: memoryview, read: Callable[[memoryview], Awaitable[int]], who: str
    ) -> None:
        """`receive_into`'s loop: fill `target` with what `read` puts into its rest (0: the
        stream ended, `PeerClosed` naming `who`); cancelled after some bytes, this direction
        breaks (the caller cannot know where the byte sequence stands)."""
        num_received = 0
        try:
            while num_received < target.nbytes:
                n = await read(target[num_received:])
                if n == 0:
                    raise PeerClosed(
                        f"{who}: stream ended after {num_received} of {target.nbytes} bytes"
                    )
                num_received += n
        except asyncio.CancelledError:
            if num_received:
                self.break_(f"receive cancelled after {num_received} bytes")
            raise


class DirectedStream(ByteStream):
    """What the TCP, TLS and slot streams share: a lock and a `DirectionState` per direction,
    and `receive_into` as repeated reads into the rest of the caller's view (`_read_into`)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._send_lock = asyncio.Lock()
        self._receive_lock = asyncio.Lock()
        self._send_state = DirectionState(f"{name} send")
        self._receive_state = DirectionState(f"{name} receive")

    async def receive_into(self, view: memoryview) -> None:
        """Fill all of `view`; `PeerClosed` if the stream ends first (see `DirectionState.fill`
        for a cancelled call)."""
        target = writable_view(view)
        async with self._receive_lock:
            self._receive_state.check()
            await self._receive_state.fill(target, self._read_into, self._name)

    @abc.abstractmethod
    async def _read_into(self, view: memoryview) -> int:
        """Put what has arrived (at least one byte, waiting for it) into `view`; 0 at end of
        stream."""


def close_both(send: DirectionState, receive: DirectionState) -> None:
    """Break both directions of a stream closed locally: every later call raises
    `StreamBroken` saying so."""
    send.break_("closed locally")
    receive.break_("closed locally")
