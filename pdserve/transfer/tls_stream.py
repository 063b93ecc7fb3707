"""TLS `ByteStream` (mutual TLS between cluster processes) over asyncio's SSL streams.

Used for the KV path's TCP transport when the cluster is given certificates (`--tls-cert`,
`--tls-key`, `--tls-ca`: `auth/tls.py`). Unlike `tcp.TcpStream` it copies: encryption needs the
bytes in its own buffers, and a received record is decrypted into a buffer first, then copied
into the caller's view (`receive_into`). `pdserve bench transfer --transports tls` measures
what that costs against plain TCP.

A stream is never reused across transfers (`reusable` is False): asyncio's reader does not say
whether the peer sent anything while the stream sat idle, and a stray byte must not be taken for
the start of the next transfer's frames. Each transfer pays one TLS handshake instead.

This module knows sockets, TLS and bytes only: no frames, no sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Sequence

from pdserve.errors import PeerClosed
from pdserve.transfer.stream import (
    DEFAULT_RECEIVE_BYTES,
    Address,
    Buffer,
    DirectedStream,
    StreamHandler,
    byte_views,
    check_max_bytes,
    serve_stream,
)

# Bytes handed to the SSL transport per write, and taken from the reader per read: a transfer
# never holds more than a few of these in Python at once, whatever its size.
_PIECE_BYTES = 1 << 20
# asyncio's reader pauses the socket once this much decrypted data waits unread.
_READ_LIMIT = 1 << 20


class TlsStream(DirectedStream):
    """One end of a TLS connection as a `ByteStream`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        peer = writer.get_extra_info("peername") or ("?", 0)
        self._peer = f"{peer[0]}:{peer[1]}"
        super().__init__(f"tls {self._peer}")
        self._closed = False

    async def send(self, buffers: Sequence[Buffer]) -> None:
        """Encrypt and write every byte of `buffers`, in order, a piece at a time."""
        async with self._send_lock:
            self._send_state.check()
            num_sent = 0
            try:
                for view in byte_views(buffers):
                    for start in range(0, view.nbytes, _PIECE_BYTES):
                        piece = view[start : start + _PIECE_BYTES]
                        self._writer.write(piece)
                        num_sent += piece.nbytes
                        await self._writer.drain()
            except asyncio.CancelledError:
                if num_sent:
                    self._send_state.break_(f"send cancelled after {num_sent} bytes")
                raise
            except (ConnectionError, ssl.SSLError, RuntimeError) as exc:
                self._send_state.check()  # closed here: StreamBroken, not the peer's doing
                raise PeerClosed(f"tls {self._peer}: send failed: {exc}") from exc

    async def receive_some(self, max_bytes: int = DEFAULT_RECEIVE_BYTES) -> bytes:
        """Between 1 and `max_bytes` bytes as soon as any arrive; b"" at end of stream."""
        check_max_bytes(max_bytes)
        async with self._receive_lock:
            self._receive_state.check()
            return await self._read(min(max_bytes, _PIECE_BYTES))

    async def _read_into(self, view: memoryview) -> int:
        data = await self._read(min(view.nbytes, _PIECE_BYTES))
        view[: len(data)] = data
        return len(data)

    async def _read(self, max_bytes: int) -> bytes:
        try:
            data = await self._reader.read(max_bytes)
        except (ConnectionError, ssl.SSLError) as exc:
            self._receive_state.check()
            raise PeerClosed(f"tls {self._peer}: receive failed: {exc}") from exc
        # `aclose` ends the reader to wake a local receive: that is this side's close.
        self._receive_state.check()
        return data

    def reusable(self) -> bool:
        """Never (see the module docstring)."""
        return False

    async def aclose(self) -> None:
        """Close the connection (idempotent); local waiters get `StreamBroken`, the peer sees
        end of stream."""
        if self._closed:
            return
        self._closed = True
        self._send_state.break_("closed locally")
        self._receive_state.break_("closed locally")
        self._writer.close()
        self._reader.feed_eof()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await self._writer.wait_closed()


async def open_tls_stream(address: Address, context: ssl.SSLContext) -> TlsStream:
    """Connect and complete the TLS handshake; failures raise `PeerClosed` naming why."""
    host, port = address
    try:
        reader, writer = await asyncio.open_connection(
            host, port, ssl=context, server_hostname=host, limit=_READ_LIMIT
        )
    except (OSError, ssl.SSLError) as exc:
        raise PeerClosed(f"tls connect to {host}:{port} failed: {exc}") from exc
    return TlsStream(reader, writer)


class TlsServer:
    """Accepts TLS connections and runs `handler(stream)` for each; closes the stream after.
    A connection over the cap (`max_connections`) is closed at once (`num_refused`)."""

    def __init__(self, handler: StreamHandler, max_connections: int | None) -> None:
        self._handler = handler
        self._max_connections = max_connections
        self._connections: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._address: Address = ("", 0)
        self.num_refused = 0

    @property
    def address(self) -> Address:
        """The (host, port) it listens on; the port is real even when asked for port 0."""
        return self._address

    async def start(self, host: str, port: int, context: ssl.SSLContext) -> None:
        """Listen on (host, port) with `context` (a server context: `auth/tls.py`)."""
        self._server = await asyncio.start_server(
            self._accepted, host, port, ssl=context, limit=_READ_LIMIT, reuse_address=True
        )
        self._address = self._server.sockets[0].getsockname()[:2]

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stream = TlsStream(reader, writer)
        if self._max_connections is not None and len(self._connections) >= self._max_connections:
            self.num_refused += 1
            await stream.aclose()
            return
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await serve_stream(self._handler, stream, "tls")
        finally:
            self._connections.discard(task)

    async def aclose(self) -> None:
        """Stop accepting, cancel running handlers and wait for them (idempotent)."""
        if self._server is not None:
            self._server.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def serve_tls(
    handler: StreamHandler,
    host: str,
    port: int,
    context: ssl.SSLContext,
    max_connections: int | None = None,
) -> TlsServer:
    """Listen on (host, port) over TLS and serve each connection with `handler`."""
    server = TlsServer(handler, max_connections)
    await server.start(host, port, context)
    return server
