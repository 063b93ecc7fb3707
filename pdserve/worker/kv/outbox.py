"""The prefill side of KV transfers: push a finished prefill's held KV to its reservation.

Life cycle of one send (a background task per request, on the event loop's thread):

    prepare ──► the signed reservation checked (signature, expiry, version), the transport
                chosen (before any prefill is spent on it)
    start ──► lease granted on the held blocks (TTL from the request, renewed by progress)
          ──► send_with_retries over the chosen transport, on a pooled connection
          ──► Ack: sent / fatal error or retries spent: failed / lease expired: cancelled
          ──► always: the engine releases the held KV

Invariant 1 (no orphan KV): whatever ends the send, its `finally` drops the lease and releases
the engine's held blocks; lease expiry cancels the task, which reaches the same `finally`.
Invariant 7 on this side: the engine frees the held blocks only after the send task ended
(`cancel` waits for it), so the sender never reads blocks that another request reuses.
Only the blocks after the decode side's cached prefix travel (`num_cached_tokens` of the
reservation, rounded down to whole blocks).

It knows the engine loop, the sender, transports and leases; not HTTP or the decode side's
internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from pdserve.errors import ConfigError
from pdserve.faults import FaultInjector, FaultRule, FaultSite
from pdserve.observability.timeline_log import EventRing
from pdserve.protocol.reservation_signing import verify_reservation
from pdserve.protocol.worker_api import ProbeResult, Reservation, SignedReservation, Transport
from pdserve.transfer.faulty import InjectorStream
from pdserve.transfer.messages import KVLayout, token_digest
from pdserve.transfer.sender import (
    LeaseHandle,
    OutgoingTransfer,
    SendPolicy,
    send_with_retries,
)
from pdserve.transfer.sender_session import SenderSession
from pdserve.transfer.stream import Address, ByteStream
from pdserve.worker.engine_loop import EngineInfo, EngineLoop
from pdserve.worker.kv import transports as kv_transports
from pdserve.worker.kv.connections import Connect, ConnectionPool
from pdserve.worker.kv.probe import PROBE_PREFIX, probe_blocks
from pdserve.worker.kv.transport_stats import TransportStats
from pdserve.worker.lease_keeper import LeaseKeeper
from pdserve.worker.metrics import SendHistograms

logger = logging.getLogger(__name__)


# (request id, destination, reason): tell the decode side its KV will not come.
GiveUpNotice = Callable[[str, "Destination", str], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Destination:
    """A reservation, checked and with its transport chosen, before any prefill is spent."""

    transfer_id: bytes
    capability_token: bytes
    transport: Transport
    address: Address
    # The reservation lease's epoch on the decode side (goes in the Begin).
    epoch: int
    num_cached_tokens: int
    # The decode worker's control URL, told when the send is given up; None: nobody is told
    # (its reservation then lapses with its lease).
    decode_url: str | None = None
    # The better transport the decode side offered that could not be used, and why (a
    # metric label, and a sentence for the log).
    downgraded_from: Transport | None = None
    downgrade_reason: str | None = None
    downgrade_detail: str | None = None
    # The decode process's instance the reservation was made in (b"": not said).
    peer_instance: bytes = b""


def layout_of(info: EngineInfo, num_blocks: int) -> KVLayout:
    """The wire layout of `num_blocks` of this engine's blocks."""
    return KVLayout(info.num_layers, num_blocks, info.block_bytes, info.dtype, info.block_size)


def outgoing(
    info: EngineInfo,
    destination: Destination,
    request_id: str,
    token_ids: Sequence[int],
    blocks: Sequence[memoryview],
    value_digest: bytes,
    cluster_key: bytes | None,
) -> tuple[OutgoingTransfer, SenderSession]:
    """One send of `blocks` (the KV of `token_ids`' blocks) to `destination`: the transfer and
    its sender session (a handoff's and a checkpoint put's alike)."""
    transfer = OutgoingTransfer(
        destination.transfer_id,
        request_id,
        1,
        layout_of(info, len(blocks)),
        len(token_ids),
        token_digest(token_ids),
        destination.capability_token,
        blocks,
        epoch=destination.epoch,
        value_digest=value_digest,
    )
    session = SenderSession(
        destination.transfer_id,
        info.fingerprint,
        cluster_key=cluster_key,
        peer_instance=destination.peer_instance,
    )
    return transfer, session


def parse_destination(
    signed: SignedReservation,
    *,
    key: bytes | None,
    now_s: float,
    local: Sequence[Transport],
    explicit: bool,
) -> Destination:
    """Check a signed reservation and choose its transport; Forbidden, ConfigError naming the
    bad field, or TransportUnavailable naming why, before anything runs."""
    verify_reservation(key, signed, now_s)
    return destination_of(signed.reservation, signed.decode_url, local=local, explicit=explicit)


def peer_destination(
    signed: SignedReservation, key: bytes | None, local: Sequence[Transport]
) -> Destination:
    """Where a checkpoint or a prefix cache's blocks go: only where the cluster signed for
    (invariant 10), over the best transport both sides have (never a forced one)."""
    return parse_destination(signed, key=key, now_s=time.time(), local=local, explicit=False)


def destination_of(
    reservation: Reservation,
    decode_url: str | None,
    *,
    local: Sequence[Transport],
    explicit: bool,
) -> Destination:
    """A reservation (already trusted) as a Destination, its transport chosen; ConfigError
    naming the bad field, or TransportUnavailable naming why."""
    fields: dict[str, bytes] = {}
    for name in ("transfer_id", "capability_token"):
        try:
            fields[name] = bytes.fromhex(getattr(reservation, name))
        except ValueError:
            raise ConfigError(f"reservation.{name}: not hex") from None
        if len(fields[name]) != 16:
            raise ConfigError(f"reservation.{name}: must be 16 bytes")
    for i, endpoint in enumerate(reservation.endpoints):
        kv_transports.parse_address(endpoint.address, f"reservation.endpoints[{i}].address")
    if reservation.num_cached_tokens < 0:
        raise ConfigError("reservation.num_cached_tokens: must be >= 0")
    choice = kv_transports.choose(reservation.endpoints, local, kv_transports.host_id(), explicit)
    return Destination(
        fields["transfer_id"],
        fields["capability_token"],
        choice.endpoint.transport,
        kv_transports.parse_address(choice.endpoint.address, "reservation.endpoints"),
        reservation.lease_epoch,
        reservation.num_cached_tokens,
        decode_url,
        choice.downgraded_from,
        choice.reason,
        choice.detail,
        bytes.fromhex(reservation.instance_id),
    )


@dataclass(frozen=True, slots=True)
class HeldSend:
    """A finished prefill's held KV and where it goes: what `KVOutbox.start` takes."""

    request_id: str
    prompt_token_ids: list[int]
    # Views of the request's KV blocks in the engine's cache, all of them (the outbox skips
    # what the destination holds already), and their ids.
    blocks: list[memoryview]
    block_ids: list[int]
    destination: Destination
    lease_ttl_s: float
    # The value canary's digest, or a future of it while its forward runs; b"": none.
    value_digest: bytes | asyncio.Future[bytes] = b""


class KVOutbox:
    """Background sends of held prefill KV, one task per request."""

    def __init__(
        self,
        engine: EngineLoop,
        info: EngineInfo,
        leases: LeaseKeeper,
        policy: SendPolicy | None = None,
        faults: FaultInjector | None = None,
        give_up: GiveUpNotice | None = None,
        events: EventRing | None = None,
        *,
        cluster_key: bytes | None = None,
        stats: TransportStats | None = None,
        connect: Connect | None = None,
    ) -> None:
        self._engine = engine
        self._info = info
        self._leases = leases
        self._policy = policy or SendPolicy()
        # The `transfer.send` site: every KV stream is wrapped only when faults are on.
        self._faults = faults
        # Tells the decode side a send was given up (best effort; its lease is the backstop).
        self._give_up = give_up
        self._key = cluster_key
        self.stats = stats or TransportStats()
        self.pool = ConnectionPool(connect or kv_transports.connect)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.num_sent = 0
        self.num_failed = 0
        # Attempts after the first, over every acknowledged send.
        self.num_send_retries = 0
        self.sends = SendHistograms()
        # Timeline events (kv_send_start, kv_send_acked, kv_send_failed); None: not recorded.
        self._events = events

    def warm(self, destination: Destination) -> None:
        """Open the stream a coming send to `destination` will use, while the prefill runs
        (no-op when one is idle or opening already)."""
        self.pool.warm(destination.transport, destination.address)

    def start(self, send: HeldSend) -> None:
        """Start sending the request's held KV; the engine's KV is released when it ends.

        `send.value_digest` may still be computing (the canary's forward on the engine
        thread): the send awaits it before it touches the KV or sends a byte."""
        info = self._info
        request_id, destination = send.request_id, send.destination
        skip = destination.num_cached_tokens // info.block_size
        end = info.num_prompt_blocks(len(send.prompt_token_ids))
        if destination.downgraded_from is not None:
            self.stats.downgraded(
                destination.downgraded_from,
                destination.transport,
                destination.downgrade_reason or "",
            )
            logger.warning(
                "KV send of %s over %s, not %s: %s",
                request_id,
                destination.transport,
                destination.downgraded_from,
                destination.downgrade_detail,
            )
        # Only the blocks the decode side does not hold already travel.
        trimmed = dataclasses.replace(
            send, blocks=send.blocks[skip:end], block_ids=send.block_ids[skip:end]
        )
        task = asyncio.get_running_loop().create_task(self._send(trimmed))
        self._tasks[request_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(request_id, None))

    async def probe(
        self, destination: Destination, num_bytes: int, timeout_s: float = 30.0
    ) -> ProbeResult:
        """Send `num_bytes` (rounded up to whole blocks) of throwaway KV to a probe reservation
        (`worker/kv/probe.py`) and time it; raises what a handoff's send would."""
        info = self._info
        num_blocks = probe_blocks(info, num_bytes)
        source = memoryview(bytearray(num_blocks * info.block_bytes))
        blocks = [
            source[i * info.block_bytes : (i + 1) * info.block_bytes] for i in range(num_blocks)
        ]
        rid = f"{PROBE_PREFIX}{destination.transfer_id.hex()[:12]}"
        transfer, session = outgoing(info, destination, rid, [], blocks, b"", self._key)
        transport, address = destination.transport, destination.address
        connect, release = self._streams(transport, address)
        # The stream is opened (and pooled) first: a NIXL or shm connection sets up and
        # registers its slot pool once, which can take seconds; the rate is the link's.
        opening = time.monotonic()
        await self.pool.release(
            transport, address, await self.pool.acquire(transport, address), True
        )
        started = time.monotonic()
        await send_with_retries(
            connect, session, transfer, self._policy, deadline=started + timeout_s, release=release
        )
        seconds = time.monotonic() - started
        total = num_blocks * info.block_bytes
        self.stats.probed(transport, f"{address[0]}:{address[1]}", total, seconds)
        return ProbeResult(
            transport=transport,
            num_bytes=total,
            seconds=seconds,
            connect_seconds=started - opening,
            downgraded_from=destination.downgraded_from,
            downgrade_reason=destination.downgrade_reason,
        )

    def _streams(
        self, transport: Transport, address: Address
    ) -> tuple[Callable[[], Awaitable[ByteStream]], Callable[[ByteStream, bool], Awaitable[None]]]:
        """A send's pooled streams to one endpoint: how it gets one, and gives it back."""
        pool, faults = self.pool, self._faults

        async def connect() -> ByteStream:
            stream = await pool.acquire(transport, address)
            return stream if faults is None else InjectorStream(stream, faults)

        async def release(stream: ByteStream, ok: bool) -> None:
            # A stream a fault acted on is in an unknown state: closed, never reused.
            if isinstance(stream, InjectorStream):
                ok, stream = ok and not stream.fired, stream.inner
            await pool.release(transport, address, stream, ok)

        return connect, release

    async def cancel(self, request_id: str) -> bool:
        """Stop the request's send and wait until it has ended (its KV is then released and
        no longer read); False if none runs."""
        task = self._tasks.get(request_id)
        if task is None:
            return False
        task.cancel()
        await asyncio.wait({task})
        return True

    async def aclose(self) -> None:
        """Cancel every send, wait until their KV is released, close pooled streams."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.pool.aclose()

    def _record(self, request_id: str, event: str, detail: str) -> None:
        if self._events is not None:
            self._events.record(request_id, event, detail)

    @property
    def num_in_flight(self) -> int:
        return len(self._tasks)

    def _damage_source(self, rule: FaultRule, blocks: list[memoryview]) -> None:
        """The `transfer.source_kv` fault: flip the top exponent bit of one KV element."""
        total = sum(v.nbytes for v in blocks)
        itemsize = 2 if self._info.dtype in ("bfloat16", "float16") else 4
        offset = (rule.offset or 0) % total
        # The element's most significant byte (little-endian), bit 6: the exponent's top bit.
        offset = offset - offset % itemsize + itemsize - 1
        for view in blocks:
            if offset < view.nbytes:
                view[offset] ^= 0x40
                return
            offset -= view.nbytes

    async def _send(self, send: HeldSend) -> None:
        request_id, prompt_token_ids, blocks = send.request_id, send.prompt_token_ids, send.blocks
        block_ids, destination, lease_ttl_s = send.block_ids, send.destination, send.lease_ttl_s
        value_digest = send.value_digest
        lease: LeaseHandle | None = None
        try:
            # The digest is of the KV as the prefill left it: awaited before anything else.
            digest = value_digest if isinstance(value_digest, bytes) else await value_digest
            if not blocks:
                return  # the decode side had the whole prompt cached
            task = asyncio.current_task()
            assert task is not None
            lease = self._leases.grant(block_ids, lease_ttl_s, f"prefill {request_id}", task.cancel)
            faults = self._faults
            if faults is not None:
                total = sum(v.nbytes for v in blocks)
                if (rule := faults.fire(FaultSite.TRANSFER_SOURCE_KV, total)) is not None:
                    self._damage_source(rule, blocks)
            transfer, session = outgoing(
                self._info, destination, request_id, prompt_token_ids, blocks, digest, self._key
            )
            transport, address = destination.transport, destination.address
            connect, release = self._streams(transport, address)
            num_bytes = sum(view.nbytes for view in blocks)
            self._record(
                request_id,
                "kv_send_start",
                f"blocks={len(blocks)} bytes={num_bytes} transport={transport}",
            )
            started = time.monotonic()
            report = await send_with_retries(
                connect,
                session,
                transfer,
                self._policy,
                deadline=self._leases.clock.now() + lease_ttl_s,
                lease=lease,
                clock=self._leases.clock,
                release=release,
            )
            seconds = time.monotonic() - started
            self.num_sent += 1
            self.num_send_retries += report.attempts - 1
            self.sends.observe(seconds, num_bytes)
            self.stats.sent(transport, f"{address[0]}:{address[1]}", num_bytes, seconds)
            self._record(
                request_id,
                "kv_send_acked",
                f"attempts={report.attempts} bytes={num_bytes} transport={transport}"
                + "".join(f"; {failure}" for failure in report.failures),
            )
        except asyncio.CancelledError:
            self.num_failed += 1
            self._record(request_id, "kv_send_failed", "cancelled")
            raise
        except Exception as exc:
            self.num_failed += 1
            self._record(request_id, "kv_send_failed", f"{type(exc).__name__}: {exc}")
            logger.warning(
                "KV send of request %s failed: %s: %s", request_id, type(exc).__name__, exc
            )
            if self._give_up is not None and destination.decode_url is not None:
                await self._give_up(request_id, destination, f"{type(exc).__name__}: {exc}")
        finally:
            self._leases.drop(lease)
            with contextlib.suppress(RuntimeError):
                await asyncio.shield(self._engine.release(request_id))
