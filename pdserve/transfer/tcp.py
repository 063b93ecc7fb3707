"""TCP `ByteStream` over raw non-blocking sockets driven by the asyncio loop.

Why raw sockets rather than asyncio streams: `StreamReader` copies every byte into its own
buffer and `StreamWriter` may join buffers; here `send` hands the caller's memoryviews to
`sendmsg` (a kernel gather-write, at most IOV_MAX views per call) and `receive_into` calls
`recv_into` on the caller's view, so KV bytes are copied only by the kernel.

Life cycle: connected → (either side) aclose → closed. `aclose` shuts down the write side first
(the peer reads every byte sent, then EOF), wakes tasks blocked on this socket with
`StreamBroken`, and closes the socket. Connection failures surface as `PeerClosed`.

This module knows sockets and bytes only: no frames, no sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from pdserve.errors import PeerClosed, StreamBroken
from pdserve.tasks import cancel_and_wait
from pdserve.transfer.stream import (
    DEFAULT_RECEIVE_BYTES,
    Address,
    Buffer,
    ByteStream,
    DirectedStream,
    StreamHandler,
    byte_views,
    check_max_bytes,
    close_both,
    serve_stream,
)

# Linux caps one sendmsg at IOV_MAX (1024) iovecs.
_IOV_MAX = 1024
_MAX_RECEIVE_SOME = 1 << 20


@dataclass(frozen=True, slots=True)
class TcpConfig:
    """Socket options applied to every connection."""

    # SO_SNDBUF in bytes (the kernel caps it at net.core.wmem_max); None keeps the default.
    send_buffer_bytes: int | None = 4 << 20
    # SO_RCVBUF in bytes; None keeps Linux receive autotuning, which grows past rmem_max.
    receive_buffer_bytes: int | None = None


def configure_socket(sock: socket.socket, config: TcpConfig) -> None:
    """Make `sock` non-blocking with TCP_NODELAY and the configured buffer sizes."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if config.send_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.send_buffer_bytes)
    if config.receive_buffer_bytes is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, config.receive_buffer_bytes)


class TcpStream(DirectedStream):
    """A connected non-blocking TCP socket as a `ByteStream`."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        try:
            host, port = sock.getpeername()[:2]
            self._peer = f"{host}:{port}"
        except OSError:
            self._peer = "unconnected"
        super().__init__(f"tcp {self._peer}")
        self._waiters: set[asyncio.Future[None]] = set()
        self._closed = False

    async def send(self, buffers: Sequence[Buffer]) -> None:
        """Gather-write `buffers` with sendmsg; only the kernel copies the payload."""
        views = byte_views(buffers)
        async with self._send_lock:
            self._send_state.check()
            num_sent = 0
            try:
                while views:
                    try:
                        n = self._sock.sendmsg(views[:_IOV_MAX])
                    except (BlockingIOError, InterruptedError):
                        await self._wait_io(for_write=True)
                        continue
                    except OSError as exc:
                        raise PeerClosed(f"tcp {self._peer}: send failed: {exc}") from exc
                    num_sent += n
                    # Drop fully sent views; trim the first partly sent one (a view slice).
                    while n:
                        if n >= views[0].nbytes:
                            n -= views.pop(0).nbytes
                        else:
                            views[0] = views[0][n:]
                            n = 0
            except asyncio.CancelledError:
                if num_sent:
                    self._send_state.break_(f"send cancelled after {num_sent} bytes")
                raise

    async def receive_some(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        """One recv of up to `max_bytes`; b"" at EOF. Cancelling it consumes nothing."""
        check_max_bytes(max_bytes)
        async with self._receive_lock:
            self._receive_state.check()
            while True:
                try:
                    # recv(n) allocates n bytes up front, so a huge bound is capped.
                    return self._sock.recv(min(max_bytes, _MAX_RECEIVE_SOME))
                except (BlockingIOError, InterruptedError):
                    await self._wait_io(for_write=False)
                except OSError as exc:
                    raise PeerClosed(f"tcp {self._peer}: receive failed: {exc}") from exc

    def reusable(self) -> bool:
        """Open both ways, and the peer has sent nothing since (no stray bytes, no FIN)."""
        if self._closed or self._send_state.reason or self._receive_state.reason:
            return False
        try:
            self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return True  # nothing to read: idle and open
        except OSError:
            return False
        return False  # b"" (the peer closed) or unexpected bytes

    async def aclose(self) -> None:
        """Send FIN after queued bytes, wake local waiters, close the socket (idempotent)."""
        if self._closed:
            return
        self._closed = True
        close_both(self._send_state, self._receive_state)
        loop = asyncio.get_running_loop()
        # Unregister before close so a reused fd number is never touched by a late waiter.
        loop.remove_reader(self._fd)
        loop.remove_writer(self._fd)
        for fut in self._waiters:
            if not fut.done():
                fut.set_exception(StreamBroken(f"tcp {self._peer}: closed locally"))
        self._waiters.clear()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        self._sock.close()

    async def _read_into(self, view: memoryview) -> int:
        # recv_into the caller's view: only the kernel copies.
        while True:
            try:
                return self._sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                await self._wait_io(for_write=False)
            except OSError as exc:
                raise PeerClosed(f"tcp {self._peer}: receive failed: {exc}") from exc

    async def _wait_io(self, for_write: bool) -> None:
        """Wait until the socket is readable/writable, or raise if closed meanwhile."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if for_write:
            loop.add_writer(self._fd, _resolve, fut)
        else:
            loop.add_reader(self._fd, _resolve, fut)
        self._waiters.add(fut)
        try:
            await fut
        finally:
            self._waiters.discard(fut)
            if not self._closed:
                if for_write:
                    loop.remove_writer(self._fd)
                else:
                    loop.remove_reader(self._fd)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def open_tcp_stream(address: Address, config: TcpConfig | None = None) -> TcpStream:
    """Connect to `address` and return the stream; connection errors raise `PeerClosed`."""
    config = config or TcpConfig()
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        configure_socket(sock, config)
        await loop.sock_connect(sock, address)
    except OSError as exc:
        sock.close()
        raise PeerClosed(f"tcp connect to {address[0]}:{address[1]} failed: {exc}") from exc
    except BaseException:
        sock.close()
        raise
    return TcpStream(sock)


class TcpServer:
    """Accepts connections and runs `handler(stream)` for each; closes the stream after.

    With `max_connections`, a connection arriving while that many are served is closed at
    once (counted in `num_refused`): an unauthenticated peer cannot tie up more.
    """

    def __init__(
        self,
        sock: socket.socket,
        handler: StreamHandler,
        config: TcpConfig,
        max_connections: int | None = None,
    ) -> None:
        self._sock = sock
        self._handler = handler
        self._config = config
        self._max_connections = max_connections
        self.num_refused = 0
        self._address: Address = sock.getsockname()[:2]
        self._connections: set[asyncio.Task[None]] = set()
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())

    @property
    def address(self) -> Address:
        """The (host, port) it listens on; the port is real even when asked for port 0."""
        return self._address

    async def aclose(self) -> None:
        """Stop accepting, cancel running handlers and wait for them (idempotent)."""
        await cancel_and_wait(self._accept_task)
        self._sock.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            if self._max_connections is not None and (
                len(self._connections) >= self._max_connections
            ):
                self.num_refused += 1
                conn.close()
                continue
            configure_socket(conn, self._config)
            task = loop.create_task(serve_stream(self._handler, TcpStream(conn), "tcp"))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)


async def serve_tcp(
    handler: StreamHandler,
    host: str = "127.0.0.1",
    port: int = 0,
    config: TcpConfig | None = None,
    max_connections: int | None = None,
) -> TcpServer:
    """Listen on (host, port) and serve each connection with `handler` (at most
    `max_connections` at once when given)."""
    config = config or TcpConfig()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return TcpServer(sock, handler, config, max_connections)


S = TypeVar("S", bound=ByteStream)
C = TypeVar("C")


class Upgraded(Generic[C, S]):
    """A transport set up over a TCP control stream (shared memory, NIXL): `connect` runs its
    handshake on an opened or accepted control stream and returns the transport's stream."""

    def __init__(self, connect: Callable[[ByteStream, C | None], Awaitable[S]]) -> None:
        self._connect = connect

    async def open(self, address: Address, config: C | None = None) -> S:
        """Connect a control stream to a server of this transport and set the transport up;
        the control stream is closed when that fails."""
        control = await open_tcp_stream(address)
        try:
            return await self._connect(control, config)
        except BaseException:
            await control.aclose()
            raise

    async def serve(
        self,
        handler: StreamHandler,
        host: str = "127.0.0.1",
        port: int = 0,
        config: C | None = None,
        *,
        handshake_timeout_s: float | None = None,
        max_connections: int | None = None,
    ) -> TcpServer:
        """Serve this transport: each accepted control connection is set up (within
        `handshake_timeout_s`: a peer that never finishes must not hold an inbox for long),
        then handled and closed."""

        async def serve_one(control: ByteStream) -> None:
            async with asyncio.timeout(handshake_timeout_s):
                stream = await self._connect(control, config)
            try:
                await handler(stream)
            finally:
                await stream.aclose()

        return await serve_tcp(serve_one, host, port, max_connections=max_connections)
