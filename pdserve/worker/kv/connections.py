"""Open KV streams kept between transfers, per (transport, address).

Opening a stream is not free: TCP pays a handshake, shared memory and NIXL also create,
pre-touch and register a slot pool of tens of MiB per connection, which would dominate a
handoff of a few MiB. So a prefill worker keeps a finished transfer's stream and hands it to the
next transfer to the same decode endpoint. A stream goes back to the pool only after an attempt
that ended cleanly (its Commit acknowledged) and only while `ByteStream.reusable()` says the
peer has neither closed it nor sent anything since; anything else is closed. Idle streams are
closed after `idle_timeout_s` (less than the receiver's idle deadline, so the sender closes
first) and at most `max_idle` are kept per endpoint.

Each stream is used by one transfer at a time: `acquire` takes it out of the pool.

`warm` opens a stream ahead of need (the worker calls it when a prefill with a destination
starts, so the connection is set up while the prompt computes, not after); an `acquire` that
finds no idle stream waits for a warm-up in flight to the same endpoint rather than opening a
second one. A failed warm-up is only logged: the transfer's own `acquire` then opens the
stream and reports why it cannot.

It knows streams and endpoints; not sessions, frames or leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdserve.protocol.worker_api import Transport
from pdserve.transfer.stream import Address, ByteStream

logger = logging.getLogger(__name__)

Key = tuple[Transport, Address]
Connect = Callable[[Transport, Address], Awaitable[ByteStream]]


@dataclass(slots=True)
class _Idle:
    stream: ByteStream
    since: float


class ConnectionPool:
    """Reusable KV streams of one worker."""

    def __init__(self, connect: Connect, max_idle: int = 4, idle_timeout_s: float = 60.0) -> None:
        self._connect = connect
        self._max_idle = max_idle
        self._idle_timeout_s = idle_timeout_s
        self._idle: dict[Key, list[_Idle]] = {}
        self._warming: dict[Key, asyncio.Task[None]] = {}
        self.num_opened = 0
        self.num_reused = 0

    def warm(self, transport: Transport, address: Address) -> None:
        """Open a stream to the endpoint in the background unless one is idle or opening."""
        key = (transport, address)
        if self._idle.get(key) or key in self._warming:
            return

        async def open_one() -> None:
            try:
                stream = await self._connect(transport, address)
            except Exception as exc:
                logger.debug(
                    "warm-up of a KV stream to %s over %s failed: %s", address, transport, exc
                )
                return
            finally:
                self._warming.pop(key, None)
            self.num_opened += 1
            await self.release(transport, address, stream, ok=True)

        self._warming[key] = asyncio.get_running_loop().create_task(open_one())

    async def acquire(self, transport: Transport, address: Address) -> ByteStream:
        """A reusable idle stream to the endpoint, or a new one."""
        key = (transport, address)
        warming = self._warming.get(key)
        if not self._idle.get(key) and warming is not None:
            await asyncio.wait([warming])
        now = time.monotonic()
        idle = self._idle.get(key, [])
        while idle:
            entry = idle.pop()
            if now - entry.since < self._idle_timeout_s and entry.stream.reusable():
                self.num_reused += 1
                return entry.stream
            await _close(entry.stream)
        stream = await self._connect(transport, address)
        self.num_opened += 1
        return stream

    async def release(
        self, transport: Transport, address: Address, stream: ByteStream, ok: bool
    ) -> None:
        """Give a stream back after an attempt: kept if it ended cleanly and is reusable."""
        idle = self._idle.setdefault((transport, address), [])
        if not ok or not stream.reusable() or len(idle) >= self._max_idle:
            await _close(stream)
            return
        idle.append(_Idle(stream, time.monotonic()))

    async def close_idle(self, older_than_s: float | None = None) -> int:
        """Close idle streams (only those idle longer than `older_than_s` when given)."""
        limit = self._idle_timeout_s if older_than_s is None else older_than_s
        now = time.monotonic()
        closed = 0
        for key, idle in list(self._idle.items()):
            keep = [e for e in idle if now - e.since < limit]
            for entry in idle:
                if entry not in keep:
                    await _close(entry.stream)
                    closed += 1
            self._idle[key] = keep
        return closed

    async def aclose(self) -> None:
        """Stop warm-ups and close every idle stream."""
        for task in list(self._warming.values()):
            task.cancel()
        await asyncio.gather(*self._warming.values(), return_exceptions=True)
        await self.close_idle(older_than_s=0.0)

    @property
    def num_idle(self) -> int:
        """Streams kept open between transfers."""
        return sum(len(v) for v in self._idle.values())


async def _close(stream: ByteStream) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(2.0):
            await stream.aclose()
