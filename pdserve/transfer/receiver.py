"""The receiving side of KV transfers: expected transfers, and the per-connection frame loop.

The owner (a decode worker) registers each reservation with `expect`: the plan (transfer id,
capability token, layout, request, token digest, lease epoch) and the destination block views
in KV memory. A connection then runs `handle`: every frame goes through that transfer's
`ReceiverSession`, which checks it; a Chunk's bytes are received straight into the destination
blocks (the byte range mapped onto block views, `byte_ranges.payload_views`), then
checksummed. `on_verified` fires once, after a Commit has matched every chunk: the only point
at which the owner may schedule the request (invariant 2). A failed check sends a Nack and
closes the connection; whatever the attempt wrote stays unverified until a later attempt
commits.

**Fencing (invariant 7: no write after the lease).** Bytes land in KV blocks only from the
task serving a connection, so "who may still write into these blocks" is a set of tasks, and
the receiver tracks it: each expected transfer has at most one writer, the connection whose
Hello opened the current attempt, until that attempt commits (a committed session refuses every
Chunk, so nothing more can land). A new attempt's Hello first cancels the previous writer and
waits until it has stopped; frames of any other connection for that transfer are refused.
`fence(transfer_id)` forgets the transfer, cancels its writer (closing the connection) and
returns only once that task has ended. The owner calls it before it frees the blocks (lease
expiry, cancellation, hand-over), so a paused sender that wakes up finds its connection gone
and, on reconnecting, an unknown transfer or an old epoch: its bytes never reach blocks that
now belong to another request. Every transport lands bytes through this task (TCP recv_into,
or a copy out of the receiver's own shm/NIXL inbox), so cancelling it stops every write.

**Liveness.** Each chunk header and each landed piece of its data (at most
`framing.PROGRESS_BYTES`) calls `on_progress` (the owner renews the reservation's lease
there): a transfer that keeps moving bytes (at least a piece per lease TTL) keeps its
reservation however long it takes; a silent one lets the lease lapse. A connection must send a valid Hello within
`handshake_timeout_s`, then each frame header, body and data within `frame_timeout_s` (the
cap on connections belongs to the server, `serve_tcp(max_connections=...)`).

One connection may carry several transfers in turn (a sender reuses its connections); it is
the writer of at most one at a time, so moving on to the next transfer releases the last.

It knows sessions, frames and byte views; not engines, schedulers or leases (the owner passes
lease checks in as callbacks).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from pdserve.errors import PdserveError, StaleAttempt, TransferError, TransferTimeout
from pdserve.transfer.byte_ranges import payload_views
from pdserve.transfer.codec import Envelope, FrameHeader
from pdserve.transfer.framing import (
    discard_data,
    read_data_into,
    read_frame,
    write_frame,
)
from pdserve.transfer.messages import Begin, Chunk, Hello, Message, Nack, NackCode, Renew, Role
from pdserve.transfer.receiver_session import ReceivePlan, ReceiverSession
from pdserve.transfer.session import FingerprintMap, Outbound
from pdserve.transfer.stream import ByteStream


@dataclass(frozen=True, slots=True)
class ReceiverLimits:
    """Deadlines and caps of the receiving endpoint."""

    # From accepting a connection to its first complete frame (the Hello).
    handshake_timeout_s: float = 5.0
    # Each later frame's header and body, and each landed piece of a chunk's data. Between
    # two transfers a reused connection may idle up to `idle_timeout_s` instead.
    frame_timeout_s: float = 10.0
    idle_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not (self.handshake_timeout_s > 0 and self.frame_timeout_s > 0):
            raise ValueError(f"ReceiverLimits: timeouts must be > 0, got {self}")
        if self.idle_timeout_s <= 0:
            raise ValueError(f"ReceiverLimits: idle_timeout_s must be > 0, got {self}")


@dataclass(slots=True)
class IncomingTransfer:
    """A reservation waiting for its KV."""

    plan: ReceivePlan
    # One writable byte view per block, in transfer order, each plan.layout.block_bytes long.
    blocks: Sequence[memoryview]
    # Called once, when the KV is complete and verified.
    on_verified: Callable[[], None]
    # Raise LeaseError once the reservation is gone (checked before Begin, Chunk, Commit).
    guard: Callable[[], object] | None = None
    renew: Callable[[Renew], object] | None = None
    # Bytes are arriving (a chunk's data is landing): keep the reservation alive. Raising
    # LeaseError stops the landing (the lease is already gone).
    on_progress: Callable[[], object] | None = None
    session: ReceiverSession | None = field(default=None, init=False)
    notified: bool = field(default=False, init=False)
    # Why the last attempt failed, for the owner's metrics.
    last_error: str | None = field(default=None, init=False)
    # The task serving the connection of the current attempt: the only one allowed to land
    # bytes in `blocks` (see the module docstring on fencing).
    writer: asyncio.Task[None] | None = field(default=None, init=False)
    # The current attempt: the transport its connection came over and when its Begin was
    # accepted (monotonic ns); with the verification time, the transfer's achieved rate.
    transport: str = field(default="", init=False)
    begin_ns: int | None = field(default=None, init=False)
    verified_ns: int | None = field(default=None, init=False)


ChunkHook = Callable[[], Awaitable[bool]]
"""Awaited once per accepted Chunk, before its data lands; False drops the connection."""

LinkHandler = Callable[[ByteStream, FrameHeader, Hello, str], Awaitable[None]]
"""Serves a connection whose first frame is a checkpoint link's Hello (`Role.REPLICA`), to
its end: the checkpoint holder's side of `link_session.py`."""


class KVReceiver:
    """All transfers one decode endpoint expects; `handle` serves one connection.

    `on_chunk` (tests' fault injection) may delay a chunk or drop the connection: the attempt
    is then lost, as when the link breaks, and the sender's retry starts a new one.
    """

    def __init__(
        self,
        fingerprint: FingerprintMap,
        on_chunk: ChunkHook | None = None,
        *,
        cluster_key: bytes | None = None,
        limits: ReceiverLimits | None = None,
        instance: bytes = b"",
    ) -> None:
        self.fingerprint = dict(fingerprint)
        # This process's life: a Hello meant for another one follows a reservation that died
        # with a previous process at this address (refused as such, not as unknown).
        self.instance = instance
        self._on_chunk = on_chunk
        self._key = cluster_key
        self.limits = limits or ReceiverLimits()
        self._expected: dict[bytes, IncomingTransfer] = {}
        self.num_verified = 0
        self.num_failed_attempts = 0
        self.num_fenced_writers = 0
        # Failed attempts by the error class that ended them ("dropped" for a cut link).
        self.failed_attempts_by_reason: Counter[str] = Counter()
        # Who serves checkpoint links arriving on this endpoint (None: they are refused).
        self.link_handler: LinkHandler | None = None

    def expect(self, incoming: IncomingTransfer) -> None:
        """Register a reservation; frames for its transfer id are accepted from now on."""
        tid = incoming.plan.transfer_id
        if tid in self._expected:
            raise TransferError(f"transfer {tid.hex()} is already expected")
        incoming.session = ReceiverSession(
            incoming.plan,
            self.fingerprint,
            guard=incoming.guard,
            renew=incoming.renew,
            cluster_key=self._key,
        )
        self._expected[tid] = incoming

    async def fence(self, transfer_id: bytes) -> None:
        """Stop accepting frames for the transfer and wait until nothing can write into its
        blocks any more (its writer, if any, is cancelled and has ended)."""
        incoming = self._expected.pop(transfer_id, None)
        if incoming is not None:
            await self._stop_writer(incoming)

    def get(self, transfer_id: bytes) -> IncomingTransfer | None:
        return self._expected.get(transfer_id)

    @property
    def num_expected(self) -> int:
        """Transfers registered and not yet fenced."""
        return len(self._expected)

    async def handle(self, stream: ByteStream, transport: str = "tcp") -> None:
        """Serve frames from one connection (arrived over `transport`) until it closes, a check
        fails or a deadline passes."""
        with contextlib.suppress(TimeoutError):  # a reply the peer would not take in time
            await self._serve(stream, transport)

    async def _serve(self, stream: ByteStream, transport: str) -> None:
        # The transfer this connection is the writer of, if any.
        current: IncomingTransfer | None = None
        timeout = self.limits.handshake_timeout_s
        first = True
        try:
            while True:
                try:
                    async with asyncio.timeout(timeout):
                        header, message = await read_frame(stream)
                except (PdserveError, TimeoutError):
                    return  # end of stream, silence or undecodable bytes: nothing to trust
                opens_link, first = first and self.link_handler is not None, False
                if opens_link and isinstance(message, Hello) and message.role is Role.REPLICA:
                    if self._meant_for_another_life(message):
                        await self._refuse_hello(stream, header, message)
                        return
                    assert self.link_handler is not None
                    # A checkpoint link: another protocol from here on, one handler.
                    await self.link_handler(stream, header, message, transport)
                    return
                incoming = self._expected.get(header.transfer_id)
                if incoming is None or incoming.session is None:
                    if isinstance(message, Hello):
                        await self._refuse_hello(stream, header, message)
                    return
                if incoming is not current:
                    if not await self._bind_writer(incoming, header, message):
                        return  # another connection owns this transfer now
                    self._release(current)
                    current = incoming
                next_timeout = await self._frame(stream, incoming, header, message, transport)
                if next_timeout is None:
                    return
                timeout = next_timeout
        finally:
            self._release(current)

    def _release(self, incoming: IncomingTransfer | None) -> None:
        """This connection stops being `incoming`'s writer (it moved on, or it ends)."""
        if incoming is not None and incoming.writer is asyncio.current_task():
            incoming.writer = None

    async def _frame(
        self,
        stream: ByteStream,
        incoming: IncomingTransfer,
        header: FrameHeader,
        message: Message,
        transport: str,
    ) -> float | None:
        """Apply one frame; the deadline for the next one, or None to close the connection."""
        session = incoming.session
        assert session is not None
        if isinstance(message, Begin) and not session.verified:
            incoming.transport, incoming.begin_ns = transport, time.monotonic_ns()
        try:
            replies = session.receive(header, message)
            if isinstance(message, Chunk):
                if self._on_chunk is not None and not await self._chunk_hook(incoming):
                    return None
                replies += await self._land(stream, incoming, message)
        except StaleAttempt:
            if header.data_len:
                await self._discard(stream, header)
            return self.limits.frame_timeout_s
        except PdserveError as exc:
            self._count_failure(incoming, f"{type(exc).__name__}: {exc}", type(exc).__name__)
            for out in session.take_outgoing():
                await self._write(stream, out)
            return None
        for out in replies:
            await self._write(stream, out)
        if session.verified and not incoming.notified:
            incoming.notified = True
            incoming.verified_ns = time.monotonic_ns()
            self.num_verified += 1
            # A committed session refuses every Chunk, so this connection can land nothing
            # more in the blocks: it stops being their writer. Fencing the transfer at the
            # hand-over then leaves alone a connection the sender keeps for its next one.
            self._release(incoming)
            incoming.on_verified()
        # After a commit the sender may keep the connection for its next transfer.
        return self.limits.idle_timeout_s if session.verified else self.limits.frame_timeout_s

    async def _write(self, stream: ByteStream, out: Outbound) -> None:
        async with asyncio.timeout(self.limits.frame_timeout_s):
            await write_frame(stream, out)

    async def _bind_writer(
        self, incoming: IncomingTransfer, header: FrameHeader, message: Message
    ) -> bool:
        """Make this connection the transfer's writer when it opens a newer attempt (Hello),
        stopping the previous writer first; False for frames of any other connection."""
        task = asyncio.current_task()
        if incoming.writer is task:
            return True
        session = incoming.session
        if not isinstance(message, Hello) or session is None or header.attempt <= session.attempt:
            return False
        await self._stop_writer(incoming)
        if self._expected.get(incoming.plan.transfer_id) is not incoming:
            return False  # fenced while we waited
        incoming.writer = task
        return True

    async def _stop_writer(self, incoming: IncomingTransfer) -> None:
        writer, incoming.writer = incoming.writer, None
        if writer is None or writer is asyncio.current_task() or writer.done():
            return
        self.num_fenced_writers += 1
        writer.cancel()
        # Wait for it to end, whatever it raises: only then is no write into the blocks
        # possible. Our own cancellation still propagates (shielding would hide it).
        await asyncio.wait({writer})

    async def _chunk_hook(self, incoming: IncomingTransfer) -> bool:
        assert self._on_chunk is not None
        if not await self._on_chunk():
            self._count_failure(incoming, "connection dropped before a chunk landed", "dropped")
            return False
        # The hook may have waited: the reservation must still own its blocks before any data
        # is written into them (the guard raises LeaseError once it does not).
        if self._expected.get(incoming.plan.transfer_id) is not incoming:
            return False
        if incoming.guard is not None:
            incoming.guard()
        return True

    async def _land(
        self, stream: ByteStream, incoming: IncomingTransfer, chunk: Chunk
    ) -> list[Outbound]:
        layout = incoming.plan.layout
        views = payload_views(incoming.blocks, layout.block_bytes, chunk.offset, chunk.num_bytes)
        if incoming.on_progress is not None:
            incoming.on_progress()  # a chunk header arrived: the sender is alive
        timeout_s = self.limits.frame_timeout_s
        try:
            digest = await read_data_into(stream, views, timeout_s, incoming.on_progress)
        except TimeoutError:
            raise TransferTimeout(
                f"chunk at byte {chunk.offset}: no data for {timeout_s}s"
            ) from None
        assert incoming.session is not None
        return incoming.session.data_received(digest)

    async def _discard(self, stream: ByteStream, header: FrameHeader) -> None:
        async with asyncio.timeout(self.limits.frame_timeout_s):
            await discard_data(stream, header.data_len)

    def _count_failure(self, incoming: IncomingTransfer, text: str, reason: str) -> None:
        incoming.last_error = text
        self.num_failed_attempts += 1
        self.failed_attempts_by_reason[reason] += 1

    def _meant_for_another_life(self, hello: Hello) -> bool:
        return bool(hello.peer_instance and self.instance and hello.peer_instance != self.instance)

    async def _refuse_hello(self, stream: ByteStream, header: FrameHeader, hello: Hello) -> None:
        transfer_id, attempt = header.transfer_id, header.attempt
        meant = hello.peer_instance
        if self._meant_for_another_life(hello):
            text = (
                f"{transfer_id.hex()} was meant for instance {meant.hex()} of this address;"
                f" this is instance {self.instance.hex()} (restarted since)"
            )
            nack = Nack(NackCode.STALE_INSTANCE, text, False)
        else:
            text = f"no reservation for transfer {transfer_id.hex()} (never made, expired or done)"
            nack = Nack(NackCode.UNKNOWN_TRANSFER, text, False)
        with contextlib.suppress(PdserveError, TimeoutError):
            async with asyncio.timeout(self.limits.frame_timeout_s):
                await write_frame(stream, Outbound(Envelope(transfer_id, attempt, 0), nack))
