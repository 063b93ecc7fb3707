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

It knows streams and endpoints; not sessions, frames or leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdserve.transfer.stream import Address, ByteStream

Key = tuple[str, Address]
Connect = Callable[[str, Address], Awaitable[ByteStream]]


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
        self.num_opened = 0
        self.num_reused = 0

    async def acquire(self, transport: str, address: Address) -> ByteStream:
        """A reusable idle stream to the endpoint, or a new one."""
        key = (transport, address)
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

    async def release(self, transport: str, address: Address, stream: ByteStream, ok: bool) -> None:
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
        """Close every idle stream."""
        await self.close_idle(older_than_s=0.0)

    @property
    def num_idle(self) -> int:
        """Streams kept open between transfers."""
        return sum(len(v) for v in self._idle.values())


async def _close(stream: ByteStream) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(2.0):
            await stream.aclose()
