"""The receiving side of KV transfers: expected transfers, and the per-connection frame loop.

The owner (a decode worker) registers each reservation with `expect`: the plan (transfer id,
capability token, layout, request, token digest) and the destination block views in KV memory.
A connection then runs `handle`: every frame goes through that transfer's `ReceiverSession`,
which checks it; Chunk data is received straight into the destination blocks, then checksummed.
`on_verified` fires once, after a Commit has matched every chunk: the only point at which the
owner may schedule the request (invariant 2). A failed check sends a Nack and closes the
connection; whatever the attempt wrote stays unverified until a later attempt commits.

It knows sessions, frames and byte views; not engines, schedulers or leases (the owner passes
lease checks in as callbacks).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from pdserve.errors import PdserveError, StaleAttempt, TransferError
from pdserve.transfer.codec import Envelope, data_checksum
from pdserve.transfer.framing import discard_data, read_data_into, read_frame, write_frame
from pdserve.transfer.messages import Chunk, Hello, Nack, NackCode, Renew
from pdserve.transfer.receiver_session import ReceivePlan, ReceiverSession
from pdserve.transfer.session import FingerprintMap, Outbound
from pdserve.transfer.stream import ByteStream


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
    session: ReceiverSession | None = field(default=None, init=False)
    notified: bool = field(default=False, init=False)
    # Why the last attempt failed, for the owner's metrics.
    last_error: str | None = field(default=None, init=False)


ChunkHook = Callable[[], Awaitable[bool]]
"""Awaited once per accepted Chunk, before its data lands; False drops the connection."""


class KVReceiver:
    """All transfers one decode endpoint expects; `handle` serves one connection.

    `on_chunk` (tests' fault injection) may delay a chunk or drop the connection: the attempt
    is then lost, as when the link breaks, and the sender's retry starts a new one.
    """

    def __init__(self, fingerprint: FingerprintMap, on_chunk: ChunkHook | None = None) -> None:
        self.fingerprint = dict(fingerprint)
        self._on_chunk = on_chunk
        self._expected: dict[bytes, IncomingTransfer] = {}
        self.num_verified = 0
        self.num_failed_attempts = 0
        # Failed attempts by the error class that ended them ("dropped" for a cut link).
        self.failed_attempts_by_reason: Counter[str] = Counter()

    def expect(self, incoming: IncomingTransfer) -> None:
        """Register a reservation; frames for its transfer id are accepted from now on."""
        tid = incoming.plan.transfer_id
        if tid in self._expected:
            raise TransferError(f"transfer {tid.hex()} is already expected")
        incoming.session = ReceiverSession(
            incoming.plan, self.fingerprint, guard=incoming.guard, renew=incoming.renew
        )
        self._expected[tid] = incoming

    def forget(self, transfer_id: bytes) -> None:
        """Stop accepting frames for this transfer (finished, cancelled or expired)."""
        self._expected.pop(transfer_id, None)

    def get(self, transfer_id: bytes) -> IncomingTransfer | None:
        return self._expected.get(transfer_id)

    async def handle(self, stream: ByteStream) -> None:
        """Serve frames from one connection until it closes or a check fails."""
        while True:
            try:
                header, message = await read_frame(stream)
            except PdserveError:
                return  # end of stream or undecodable bytes: nothing more can be trusted
            incoming = self._expected.get(header.transfer_id)
            if incoming is None or incoming.session is None:
                if isinstance(message, Hello):
                    await self._refuse_unknown(stream, header.transfer_id, header.attempt)
                return
            session = incoming.session
            try:
                replies = session.receive(header, message)
                if isinstance(message, Chunk):
                    if self._on_chunk is not None and not await self._chunk_hook(incoming):
                        return
                    replies += await self._land(stream, incoming, message)
            except StaleAttempt:
                if header.data_len:
                    await discard_data(stream, header.data_len)
                continue
            except PdserveError as exc:
                incoming.last_error = f"{type(exc).__name__}: {exc}"
                self.num_failed_attempts += 1
                self.failed_attempts_by_reason[type(exc).__name__] += 1
                for out in session.take_outgoing():
                    await write_frame(stream, out)
                return
            for out in replies:
                await write_frame(stream, out)
            if session.verified and not incoming.notified:
                incoming.notified = True
                self.num_verified += 1
                incoming.on_verified()

    async def _chunk_hook(self, incoming: IncomingTransfer) -> bool:
        assert self._on_chunk is not None
        if not await self._on_chunk():
            incoming.last_error = "connection dropped before a chunk landed"
            self.num_failed_attempts += 1
            self.failed_attempts_by_reason["dropped"] += 1
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
        views = incoming.blocks[chunk.first_block : chunk.first_block + chunk.num_blocks]
        await read_data_into(stream, views)
        assert incoming.session is not None
        return incoming.session.data_received(data_checksum(views))

    async def _refuse_unknown(self, stream: ByteStream, transfer_id: bytes, attempt: int) -> None:
        text = f"no reservation for transfer {transfer_id.hex()} (never made, expired or done)"
        nack = Nack(NackCode.UNKNOWN_TRANSFER, text, False)
        await write_frame(stream, Outbound(Envelope(transfer_id, attempt, 0), nack))
