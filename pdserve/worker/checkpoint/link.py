"""The writer's end of checkpoint replication links: one long-lived connection per holder.

A put over a link is one frame (`Put` + the block copies) and one reply, with the handshake
paid once per connection (`transfer/link_session.py`), where a put over a transfer session
pays an HTTP reservation, a handshake and three round trips. Puts of one worker's requests to
one holder share its link, one at a time, in the order they were asked.

Failure: a refused put (`CheckpointRefused`: full, chain, version) leaves the link open. Any
other failure (timeout, closed connection, cancellation in the middle of a frame) closes it;
the next put opens a new one. A put whose link turns out closed, when that link had already
carried a put, is tried once more on a fresh link: the holder may have closed an idle
connection, and a put is idempotent there (the same blocks after the same parent are held
once). After any other failure (a timeout: the holder is paused or gone) puts to that holder
fail at once for `timeout_s`, so the replicas queued behind the first do not each wait out
their own timeout.

It knows the link session, frames and the transport connector; not HTTP, replicas or engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

from pdserve.errors import (
    CheckpointRefused,
    LinkUnsupported,
    PdserveError,
    PeerClosed,
    TransferTimeout,
)
from pdserve.transfer.codec import data_checksum
from pdserve.transfer.framing import read_frame, write_frame
from pdserve.transfer.link_session import LinkWriter
from pdserve.transfer.messages import Put
from pdserve.transfer.stream import Address, ByteStream
from pdserve.worker.engine_loop import EngineInfo
from pdserve.worker.kv import transports as kv_transports
from pdserve.worker.kv.connections import Connect


class _Link:
    """One connection to one holder, its session, and the lock that orders its puts."""

    def __init__(self, address: Address) -> None:
        self.address = address
        self.lock = asyncio.Lock()
        self.stream: ByteStream | None = None
        self.session: LinkWriter | None = None
        self.num_puts = 0
        # The holder's instance the link's Hello names (b"": any).
        self.peer_instance = b""
        # Monotonic second until which puts fail at once, and why (after a failure).
        self.down_until = 0.0
        self.down_reason = ""

    async def close(self) -> None:
        stream, self.stream, self.session = self.stream, None, None
        if stream is not None:
            with contextlib.suppress(Exception):
                await stream.aclose()


class CheckpointLinks:
    """This worker's links to checkpoint holders, opened on first use."""

    def __init__(
        self,
        info: EngineInfo,
        cluster_key: bytes | None,
        connect: Connect | None = None,
        *,
        timeout_s: float = 10.0,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self._info = info
        self._key = cluster_key
        self._connect = connect or kv_transports.connect
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._links: dict[Address, _Link] = {}
        self.num_opened = 0

    async def put(
        self, address: Address, put: Put, blocks: Sequence[memoryview], peer_instance: bytes = b""
    ) -> int:
        """Send one put to the holder at `address` (the process instance `peer_instance`, when
        known) until it is answered; returns its bytes. CheckpointRefused when the holder
        refused it, a transfer error when it failed (TransferRefused naming STALE_INSTANCE
        when another life of the holder answers)."""
        link = self._links.setdefault(address, _Link(address))
        async with link.lock:
            if peer_instance != link.peer_instance:
                # A new life of the holder at this address: a link to the old one is no use.
                await link.close()
                link.peer_instance, link.down_until = peer_instance, 0.0
            now = time.monotonic()
            if now < link.down_until:
                raise PeerClosed(
                    f"checkpoint link to {address[0]}:{address[1]} failed"
                    f" {self._timeout_s - (link.down_until - now):.1f}s ago: {link.down_reason}"
                )
            reused = link.stream is not None and link.num_puts > 0
            try:
                try:
                    return await self._put(link, put, blocks)
                except PeerClosed:
                    if not reused:
                        raise
                return await self._put(link, put, blocks)
            except (CheckpointRefused, LinkUnsupported):
                raise
            except PdserveError as exc:
                link.down_until = time.monotonic() + self._timeout_s
                link.down_reason = f"{type(exc).__name__}: {exc}"
                raise

    async def _put(self, link: _Link, put: Put, blocks: Sequence[memoryview]) -> int:
        where = f"checkpoint link to {link.address[0]}:{link.address[1]}"
        ok = False
        try:
            if link.session is None:
                await self._open(link)
            assert link.stream is not None and link.session is not None
            checksum = data_checksum(blocks)  # signed by the Put's MAC, and framed as is
            out = link.session.put(put, checksum)
            async with asyncio.timeout(self._timeout_s):
                await write_frame(link.stream, out, blocks, checksum=checksum)
                header, message = await read_frame(link.stream)
            try:
                link.session.receive_reply(header, message)
            except CheckpointRefused:
                ok = True  # only this put was refused: the link is in step
                raise
            ok = True
            link.num_puts += 1
            return sum(b.nbytes for b in blocks)
        except TimeoutError:
            raise TransferTimeout(f"{where}: no answer within {self._timeout_s}s") from None
        except OSError as exc:
            raise PeerClosed(f"{where}: {exc}") from None
        finally:
            # Anything but an answered put (an error, a cancellation mid-frame) leaves the
            # stream out of step: close it, the next put opens a new link.
            if not ok:
                await link.close()

    async def _open(self, link: _Link) -> None:
        session = LinkWriter(self._info.fingerprint, self._key, peer_instance=link.peer_instance)
        async with asyncio.timeout(self._connect_timeout_s):
            stream = await self._connect("tcp", link.address)
        link.stream, link.session, link.num_puts = stream, session, 0
        async with asyncio.timeout(self._timeout_s):
            await write_frame(stream, session.hello())
            header, message = await read_frame(stream)
        session.receive_hello(header, message)
        self.num_opened += 1

    async def aclose(self) -> None:
        """Close every link."""
        links, self._links = list(self._links.values()), {}
        for link in links:
            await link.close()
