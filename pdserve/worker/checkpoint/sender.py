"""Sending host copies of KV blocks over the KV data plane (checkpoint puts and pulls).

A checkpoint's bytes travel exactly as a handoff's: a `SenderSession` per transfer (Hello with
the fingerprint and cluster MAC, Begin naming the reservation's capability token and lease
epoch, checksummed chunks, Commit, Ack), retried by `send_with_retries`, over a pooled stream
of the transport the reservation chose. The blocks are copies owned by the caller (a decode
worker's snapshot, a holder's tier), never live engine blocks, so no engine lease is needed
while they are read.

It knows the transfer sender and the connection pool; not HTTP, the engine or the holder.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.clock import Clock, MonotonicClock
from pdserve.transfer.sender import SendPolicy, send_with_retries
from pdserve.transfer.stream import ByteStream
from pdserve.worker.engine_loop import EngineInfo
from pdserve.worker.kv import transports as kv_transports
from pdserve.worker.kv.connections import Connect, ConnectionPool
from pdserve.worker.kv.outbox import Destination, outgoing


def put_request_id(owner: str, first_version: int) -> str:
    """The request id a checkpoint put's transfer names (both sides derive it)."""
    return f"{owner}@{first_version}"


class BlockSender:
    """Sends block copies to reservations, one transfer per call, over pooled streams."""

    def __init__(
        self,
        info: EngineInfo,
        policy: SendPolicy,
        cluster_key: bytes | None,
        connect: Connect | None = None,
        clock: Clock | None = None,
    ) -> None:
        self._info = info
        self._policy = policy
        self._key = cluster_key
        self._clock = clock or MonotonicClock()
        self.pool = ConnectionPool(connect or kv_transports.connect)
        self.num_sent = 0
        self.num_bytes_sent = 0

    async def send(
        self,
        destination: Destination,
        request_id: str,
        token_ids: Sequence[int],
        blocks: Sequence[memoryview],
        timeout_s: float,
        value_digest: bytes = b"",
    ) -> int:
        """Send `blocks` (the KV of `token_ids`' blocks) until acknowledged; returns bytes.
        Raises the transfer's typed error when it cannot be delivered in `timeout_s`."""
        transfer, session = outgoing(
            self._info, destination, request_id, token_ids, blocks, value_digest, self._key
        )
        pool, transport, address = self.pool, destination.transport, destination.address

        async def connect() -> ByteStream:
            return await pool.acquire(transport, address)

        async def release(stream: ByteStream, ok: bool) -> None:
            await pool.release(transport, address, stream, ok)

        await send_with_retries(
            connect,
            session,
            transfer,
            self._policy,
            deadline=self._clock.now() + timeout_s,
            clock=self._clock,
            release=release,
        )
        num_bytes = transfer.layout.payload_bytes
        self.num_sent += 1
        self.num_bytes_sent += num_bytes
        return num_bytes

    async def aclose(self) -> None:
        await self.pool.aclose()
