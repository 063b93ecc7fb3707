"""The sending side of a KV transfer: one attempt over a stream, and the retry loop around it.

An attempt is Hello ⇄ Hello, Begin → Ack, the chunks (data straight from KV memory), Commit →
Ack. Chunks are byte ranges of at most `frame_bytes` of the payload (the blocks end to end,
`byte_ranges`), whatever the block size, so a transfer of any size streams one frame at a time
with no copy. They are streamed without per-chunk replies; a receiver that refuses one answers
with a Nack, which the sender reads where it expects the commit Ack. Every chunk the transport
accepted is progress: it renews the sender's own hold (`LeaseHandle.heartbeat`), as the
receiver's replies do, so a long transfer that moves keeps its snapshot however long it takes.

`send_with_retries` runs attempts until one is acknowledged: each new attempt (same transfer id,
attempt + 1) resends the whole snapshot, which the prefill side holds unchanged under its lease
until the Ack. Between attempts it waits a full-jitter backoff that never crosses the lease
deadline. Retryable errors (damage, timeouts, lost connections) are retried; fatal ones
(fingerprint, capability, lease lost) end the transfer at once. The lease is checked (fenced)
before every attempt and released after the Ack, and only then.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from pdserve.clock import Clock, MonotonicClock
from pdserve.errors import PdserveError, PeerClosed, ProtocolError, TransferTimeout
from pdserve.transfer.backoff import Backoff, BackoffPolicy
from pdserve.transfer.byte_ranges import DEFAULT_FRAME_BYTES, payload_views, split_payload
from pdserve.transfer.codec import MAX_DATA_BYTES, data_checksum
from pdserve.transfer.framing import read_frame, write_frame
from pdserve.transfer.lease import LeaseTable
from pdserve.transfer.messages import Begin, Chunk, KVLayout
from pdserve.transfer.sender_session import SenderAction, SenderSession, SenderState
from pdserve.transfer.stream import ByteStream


@dataclass(frozen=True, slots=True)
class OutgoingTransfer:
    """One request's KV as the sender holds it."""

    transfer_id: bytes
    request_id: str
    # Version of the held KV; a retry resends the same snapshot.
    snapshot_version: int
    layout: KVLayout
    num_tokens: int
    token_digest: bytes
    # Shared secret of this transfer, issued by the receiver's reservation.
    capability_token: bytes
    # One byte view per block, in transfer order, each layout.block_bytes long.
    blocks: Sequence[memoryview]
    # The reservation lease's epoch on the receiving side (its fencing token).
    epoch: int = 0
    # What the KV computes, for the receiver to check by value (the worker's canary); b"": none.
    value_digest: bytes = b""


@dataclass(frozen=True, slots=True)
class SendPolicy:
    """Chunking, deadlines and retries of the sending side."""

    # Data bytes per Chunk frame (the last one of a transfer may be shorter).
    frame_bytes: int = DEFAULT_FRAME_BYTES
    # Deadline for each chunk's send and for each reply: a stalled link is noticed this fast.
    # A 4 MiB frame takes ~2 ms over loopback TCP, ~6 ms at 0.7 GB/s.
    chunk_timeout_s: float = 2.0
    # Deadline for opening the connection.
    connect_timeout_s: float = 5.0
    backoff: BackoffPolicy = field(default_factory=BackoffPolicy)
    # Attempts in all (the first included); the lease deadline may end them sooner.
    max_attempts: int = 4

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"SendPolicy: max_attempts must be >= 1, got {self.max_attempts}")
        if not 1 <= self.frame_bytes <= MAX_DATA_BYTES:
            raise ValueError(
                f"SendPolicy: frame_bytes must be in 1..{MAX_DATA_BYTES}, got {self.frame_bytes}"
            )


@dataclass(frozen=True, slots=True)
class LeaseHandle:
    """The sender's lease on the blocks it is sending."""

    table: LeaseTable
    lease_id: int
    epoch: int
    # When set, every reply from the receiver renews the lease for this long: a decode side
    # that keeps answering keeps the snapshot held; a dead one lets the lease lapse.
    renew_ttl_s: float | None = None

    def heartbeat(self) -> None:
        """The receiver answered: extend the lease (no-op without `renew_ttl_s`)."""
        if self.renew_ttl_s is not None:
            self.table.renew(self.lease_id, self.epoch, self.renew_ttl_s)


@dataclass(frozen=True, slots=True)
class SendReport:
    """What a finished transfer took."""

    attempts: int
    bytes_sent: int
    # Why each failed attempt failed, in order.
    failures: tuple[str, ...]


async def _reply(
    stream: ByteStream,
    session: SenderSession,
    timeout_s: float,
    on_reply: Callable[[], object] | None,
) -> SenderAction:
    async with asyncio.timeout(timeout_s):
        header, message = await read_frame(stream)
    action = session.receive(header, message)
    if on_reply is not None:
        on_reply()
    return action


def _expect(action: SenderAction, want: SenderAction, session: SenderSession) -> None:
    if action is not want:
        raise ProtocolError(
            f"sender {session.transfer_id.hex()}: got {action.name}, want {want.name}"
        )


async def send_attempt(
    stream: ByteStream,
    session: SenderSession,
    transfer: OutgoingTransfer,
    policy: SendPolicy,
    on_reply: Callable[[], object] | None = None,
) -> int:
    """Run one attempt to its Ack; returns the data bytes sent. `on_reply` runs per reply and
    per chunk the transport accepted (both are signs of a live receiver)."""
    t = policy.chunk_timeout_s
    async with asyncio.timeout(t):
        await write_frame(stream, session.send_hello())
    _expect(await _reply(stream, session, t, on_reply), SenderAction.SEND_BEGIN, session)
    begin = Begin(
        transfer.transfer_id,
        transfer.request_id,
        transfer.snapshot_version,
        transfer.layout,
        transfer.num_tokens,
        transfer.token_digest,
        transfer.capability_token,
        transfer.epoch,
    )
    async with asyncio.timeout(t):
        await write_frame(stream, session.send_begin(begin))
    action = await _reply(stream, session, t, on_reply)
    if action is SenderAction.RELEASE_LEASE:
        return 0  # a retry of a transfer the receiver had already committed
    _expect(action, SenderAction.SEND_CHUNKS, session)
    sent = 0
    layout = transfer.layout
    for offset, num_bytes in split_payload(layout.payload_bytes, policy.frame_bytes):
        views = payload_views(transfer.blocks, layout.block_bytes, offset, num_bytes)
        chunk = Chunk(offset, num_bytes, data_checksum(views))
        async with asyncio.timeout(t):
            await write_frame(stream, session.send_chunk(chunk), views, verify_data=False)
        sent += num_bytes
        if on_reply is not None:
            on_reply()
    async with asyncio.timeout(t):
        await write_frame(stream, session.send_commit(transfer.value_digest))
    _expect(await _reply(stream, session, t, on_reply), SenderAction.RELEASE_LEASE, session)
    return sent


async def send_with_retries(
    connect: Callable[[], Awaitable[ByteStream]],
    session: SenderSession,
    transfer: OutgoingTransfer,
    policy: SendPolicy,
    *,
    deadline: float,
    lease: LeaseHandle | None = None,
    clock: Clock | None = None,
    rng: random.Random | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    release: Callable[[ByteStream, bool], Awaitable[None]] | None = None,
) -> SendReport:
    """Send until acknowledged, retrying retryable failures with backoff until `deadline`.

    Raises the last error when `policy.max_attempts` or the deadline run out or a failure is
    fatal. On success the lease (if given) is released. Each attempt's stream goes to
    `release(stream, ok)` when given (a connection pool), else it is closed.
    """
    clock = clock or MonotonicClock()
    backoff = Backoff(policy.backoff, rng or random.Random(), deadline)
    failures: list[str] = []
    while True:
        if lease is not None:
            lease.table.check(lease.lease_id, lease.epoch)
        try:
            heartbeat = lease.heartbeat if lease is not None else None
            sent = await _one_attempt(connect, session, transfer, policy, heartbeat, release)
        except PdserveError as exc:
            failures.append(f"attempt {session.attempt}: {type(exc).__name__}: {exc}")
            out_of_attempts = len(failures) >= policy.max_attempts
            delay = (
                None if out_of_attempts or not exc.retryable else backoff.next_delay(clock.now())
            )
            if delay is None:
                raise
            await sleep(delay)
            if session.state is not SenderState.IDLE:  # IDLE: the connect failed, nothing sent
                session.restart()
            continue
        if lease is not None:
            lease.table.release(lease.lease_id, lease.epoch)
        return SendReport(session.attempt, sent, tuple(failures))


async def _one_attempt(
    connect: Callable[[], Awaitable[ByteStream]],
    session: SenderSession,
    transfer: OutgoingTransfer,
    policy: SendPolicy,
    on_reply: Callable[[], object] | None = None,
    release: Callable[[ByteStream, bool], Awaitable[None]] | None = None,
) -> int:
    where = f"transfer {transfer.transfer_id.hex()} attempt {session.attempt}"
    try:
        async with asyncio.timeout(policy.connect_timeout_s):
            stream = await connect()
    except TimeoutError:
        raise TransferTimeout(f"{where}: connect timed out") from None
    except OSError as exc:
        raise PeerClosed(f"{where}: connect failed: {exc}") from None
    ok = False
    try:
        sent = await send_attempt(stream, session, transfer, policy, on_reply)
        ok = True
        return sent
    except TimeoutError:
        raise TransferTimeout(f"{where}: no progress within {policy.chunk_timeout_s}s") from None
    except OSError as exc:
        raise PeerClosed(f"{where}: {exc}") from None
    finally:
        if release is None:
            await stream.aclose()
        else:
            await release(stream, ok)
