"""The decode side of KV transfers: reservations, the receiver and its endpoints.

Life cycle of one reservation (all on the event loop's thread):

    reserve ──► PENDING (engine: remote-KV allocation; receiver: expects the transfer id;
       │                 lease over the blocks that will be written, epoch in the reservation)
       ├── receiver verified the commit ──► VERIFIED ──take──► handed to the decoder
       │                                                        (writer fenced, lease dropped)
       └── lease expired / take timed out / cancel / abort ──► CANCELLED (writer fenced first,
                                                       then the engine request aborted: every
                                                       block back in the pool)

Invariants:
- Verified state only (2): a request is scheduled only after `take` saw VERIFIED; the engine
  is only told by the decoder, after take (and after the value check of the canary there).
- No leak (1): every PENDING reservation ends in exactly one of handed-over or cancelled.
- No write after the lease (7): blocks are freed only after `KVReceiver.fence` has returned,
  i.e. once the connection that could write into them has been cancelled and has ended. A
  sender that was paused and wakes up finds its connection gone; reconnecting, it names a
  transfer the receiver no longer expects (refused) or an old epoch (refused).
- Liveness, not duration (the lease's TTL is its silence budget): every piece of chunk data
  that lands renews the reservation's lease, as do the router's /renew calls while the
  prefill runs; a transfer that stops moving lets it lapse.

Cancellation is one task per reservation: a second `cancel` (the reaper, /release, /decode's
error path) awaits the first, so nobody frees blocks while a writer is still being fenced.

It knows the engine loop, the receiver, transports and leases; not HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import os
from dataclasses import dataclass, field

from pdserve.errors import KVNotReady, RequestNotFound, Unauthorized
from pdserve.faults import FaultInjector, FaultKind, FaultSite, perform
from pdserve.observability.timeline_log import EventRing
from pdserve.protocol.worker_api import (
    KVAbortRequest,
    KVEndpoint,
    Reservation,
    ReserveRequest,
    Transport,
)
from pdserve.transfer.messages import KVLayout, token_digest
from pdserve.transfer.receiver import IncomingTransfer, KVReceiver, ReceiverLimits
from pdserve.transfer.receiver_session import ReceivePlan
from pdserve.transfer.sender import LeaseHandle
from pdserve.transfer.tcp import TcpServer
from pdserve.transfer.tls_stream import TlsServer
from pdserve.worker.engine_loop import EngineInfo, EngineLoop
from pdserve.worker.kv import transports as kv_transports
from pdserve.worker.kv.probe import ProbeSink
from pdserve.worker.kv.transport_stats import TransportStats
from pdserve.worker.lease_keeper import LeaseKeeper


@dataclass(slots=True)
class _Pending:
    request_id: str
    transfer_id: bytes
    lease: LeaseHandle
    capability_token: bytes
    # Blocks allocated for the request (the reserved-blocks gauge sums them).
    num_blocks: int
    # Blocks that travel (0: the whole prompt was cached here, nothing is received).
    num_incoming_blocks: int
    # Set once: verified, or cancelled (then `cancel_reason` says why).
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    verified: bool = False
    cancel_reason: str | None = None
    # Set once verified: the sender's value digest from the Commit (the canary), and how the
    # bytes came (transport, bytes, seconds from Begin to Commit).
    value_digest: bytes = b""
    transport: str = ""
    num_bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Received:
    """What `take` hands the decoder: the KV is verified and its blocks are the request's."""

    # Blocks that arrived over the transfer (0 when the prompt was cached here).
    num_blocks: int
    # The sender's value digest of that KV; b"" when it sent none.
    value_digest: bytes
    # How it came: transport ("" when nothing travelled), bytes, seconds, and whether that
    # was far below the transport's expected rate.
    transport: str = ""
    num_bytes: int = 0
    seconds: float = 0.0
    slow: bool = False


class KVInbox:
    """Every reservation of one decode worker and the endpoints its KV arrives on."""

    def __init__(
        self,
        engine: EngineLoop,
        info: EngineInfo,
        leases: LeaseKeeper,
        faults: FaultInjector | None = None,
        events: EventRing | None = None,
        *,
        cluster_key: bytes | None = None,
        limits: ReceiverLimits | None = None,
        transports: tuple[Transport, ...] = ("tcp",),
        max_connections: int | None = 64,
        stats: TransportStats | None = None,
        instance_id: str = "",
    ) -> None:
        self._engine = engine
        # This process's life, named in every reservation (its KV Hello must name it too).
        self.instance_id = instance_id
        self._info = info
        self._leases = leases
        self._faults = faults
        # No hook at all when faults are off: the receiver's chunk path stays as it is.
        self.receiver = KVReceiver(
            info.fingerprint,
            on_chunk=self._chunk_fault if faults is not None else None,
            cluster_key=cluster_key,
            limits=limits,
            instance=bytes.fromhex(instance_id),
        )
        self._transports = transports
        self._max_connections = max_connections
        self.stats = stats or TransportStats()
        # Throwaway transfers of the router's pair probes (scratch memory, no engine blocks).
        self.probes = ProbeSink(self.receiver, info, lambda: self.endpoints, self.stats)
        self._pending: dict[str, _Pending] = {}
        self._cancelling: dict[str, asyncio.Task[int]] = {}
        # Cancellations the lease reaper started (kept referenced until they end).
        self._spawned: set[asyncio.Task[int]] = set()
        self._servers: list[tuple[Transport, TcpServer | TlsServer]] = []
        self._advertise_host: str | None = None
        self.num_cancelled = 0
        # Timeline events (reserved, kv_verified, reservation_cancelled); None: not recorded.
        self._events = events

    async def start(self, host: str, port: int, advertise_host: str | None = None) -> str:
        """Listen on `host` for each transport (TCP on `port`, the others on free ports);
        returns the TCP endpoint "host:port", naming `advertise_host` when given."""
        self._advertise_host = advertise_host
        limits = self.receiver.limits
        for transport in self._transports:
            server = await kv_transports.serve(
                transport,
                functools.partial(self.receiver.handle, transport=transport),
                host,
                port if transport == "tcp" else 0,
                handshake_timeout_s=limits.handshake_timeout_s,
                max_connections=self._max_connections,
            )
            self._servers.append((transport, server))
        return self.address

    @property
    def endpoints(self) -> list[KVEndpoint]:
        """Every transport served, best first, as reservations advertise them."""
        host_id = kv_transports.host_id()
        return [
            KVEndpoint(transport=t, address=self._advertised(server), host_id=host_id)
            for t, server in self._servers
        ]

    @property
    def address(self) -> str:
        """ "host:port" of the first endpoint served (TCP when served). Reservations carry it
        to another machine, where a wildcard bind (0.0.0.0) would mean that machine itself."""
        assert self._servers, "KVInbox.start was not called"
        by_transport = dict(self._servers)
        return self._advertised(by_transport.get("tcp", self._servers[0][1]))

    def _advertised(self, server: TcpServer | TlsServer) -> str:
        host, port = server.address
        host = self._advertise_host or host
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def num_refused_connections(self) -> int:
        """Connections closed on arrival because the cap was reached."""
        return sum(server.num_refused for _, server in self._servers)

    async def aclose(self) -> None:
        """Stop the endpoints and cancel every pending reservation."""
        for _, server in self._servers:
            await server.aclose()
        await self.probes.aclose()
        for request_id in list(self._pending):
            await self.cancel(request_id, "worker stopping")

    async def reserve(self, body: ReserveRequest) -> Reservation:
        """Allocate the blocks, expect the transfer and lease the blocks it will write."""
        rid = body.request_id
        params = body.sampling
        num_cached, block_ids, views = await self._engine.add_remote(
            rid, body.prompt_token_ids, params
        )
        try:
            info = self._info
            # Blocks the prefix cache already filled do not travel; the rest up to the prompt's
            # last block do (the extra block for the first decoded token is written locally).
            skip = num_cached // info.block_size
            end = info.num_prompt_blocks(len(body.prompt_token_ids))
            transfer_id, token = os.urandom(16), os.urandom(16)
            lease = self._leases.grant(
                block_ids[skip:end],
                body.lease_ttl_s,
                f"reservation {rid}",
                lambda: self._spawn_cancel(rid, f"lease expired after {body.lease_ttl_s}s"),
            )
            pending = _Pending(rid, transfer_id, lease, token, len(block_ids), max(0, end - skip))
            self._pending[rid] = pending
            self._record(rid, "reserved", f"blocks={len(block_ids)} cached_tokens={num_cached}")
            if end > skip:
                layout = KVLayout(
                    info.num_layers, end - skip, info.block_bytes, info.dtype, info.block_size
                )
                plan = ReceivePlan(
                    transfer_id,
                    token,
                    layout,
                    rid,
                    len(body.prompt_token_ids),
                    token_digest(body.prompt_token_ids),
                    epoch=lease.epoch,
                )
                self.receiver.expect(
                    IncomingTransfer(
                        plan,
                        self._destination(views[skip:end]),
                        on_verified=lambda: self._verified(pending),
                        guard=lambda: self._leases.check(lease),
                        on_progress=lease.heartbeat,
                    )
                )
            else:
                self._verified(pending)  # the whole prompt was cached here: nothing to receive
        except BaseException:
            self._pending.pop(rid, None)
            await self._engine.abort(rid)
            raise
        return Reservation(
            request_id=rid,
            transfer_id=transfer_id.hex(),
            capability_token=token.hex(),
            endpoints=self.endpoints,
            lease_epoch=lease.epoch,
            num_cached_tokens=num_cached,
            lease_ttl_s=body.lease_ttl_s,
            instance_id=self.instance_id,
        )

    async def take(self, request_id: str, timeout_s: float) -> Received:
        """Wait until the reservation's KV is verified and hand it over to the caller.

        The wait ends sooner if the reservation is cancelled (its lease lapses when the
        transfer goes silent). Raises RequestNotFound for an unknown reservation, KVNotReady
        (after cancelling it) when the KV is not verified in time or it was cancelled.
        """
        pending = self._pending.get(request_id)
        if pending is None:
            raise RequestNotFound(f"no reservation for request {request_id}")
        try:
            async with asyncio.timeout(timeout_s):
                await pending.settled.wait()
        except TimeoutError:
            await self.cancel(request_id, f"KV not verified within {timeout_s}s")
        if pending.cancel_reason is not None:
            raise KVNotReady(
                f"request {request_id}: reservation cancelled: {pending.cancel_reason}"
            )
        # Verified: the connection that delivered it can write no more (its session is
        # committed), but fence anyway so no task of this transfer outlives the hand-over.
        await self.receiver.fence(pending.transfer_id)
        self._pending.pop(request_id, None)
        self._leases.drop(pending.lease)
        slow = False
        if pending.transport:
            slow = self.stats.received(pending.transport, "", pending.num_bytes, pending.seconds)
        return Received(
            pending.num_incoming_blocks,
            pending.value_digest,
            pending.transport,
            pending.num_bytes,
            pending.seconds,
            slow,
        )

    def renew(self, request_id: str) -> float:
        """Extend a pending reservation's lease by its TTL; returns the TTL.

        RequestNotFound once it is gone (expired, cancelled): the router learns at once that
        the prefill it waits on has nowhere to go.
        """
        pending = self._pending.get(request_id)
        if pending is None:
            raise RequestNotFound(f"no reservation for request {request_id} to renew")
        if not pending.verified:  # verified: handed over, nothing left to keep alive
            pending.lease.heartbeat()
        return pending.lease.renew_ttl_s or 0.0

    async def abort(self, body: KVAbortRequest) -> bool:
        """The sender gave up: cancel the reservation now (its /decode fails at once).

        Only the holder of the reservation's transfer id and capability token may do it;
        False when no such reservation is pending (verified, released or expired already).
        """
        pending = self._pending.get(body.request_id)
        if pending is None or pending.verified:
            return False
        try:
            transfer_id = bytes.fromhex(body.transfer_id)
            token = bytes.fromhex(body.capability_token)
        except ValueError:
            raise Unauthorized(f"kv_abort of {body.request_id}: ids are not hex") from None
        if not (
            hmac.compare_digest(transfer_id, pending.transfer_id)
            and hmac.compare_digest(token, pending.capability_token)
        ):
            raise Unauthorized(f"kv_abort of {body.request_id}: not this reservation's sender")
        await self.cancel(body.request_id, f"sender gave up: {body.reason}")
        return True

    async def cancel(self, request_id: str, reason: str) -> int:
        """Drop a pending reservation: fence its writer, then free its blocks; returns blocks
        freed (0 if none). A cancellation already under way is awaited, not repeated."""
        running = self._cancelling.get(request_id)
        if running is not None:
            return await asyncio.shield(running)
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return 0
        pending.cancel_reason = reason
        pending.settled.set()
        task = asyncio.get_running_loop().create_task(self._cancel(pending, reason))
        self._cancelling[request_id] = task
        task.add_done_callback(lambda _: self._cancelling.pop(request_id, None))
        # Shielded: a caller that is itself cancelled must not stop the freeing half-way.
        return await asyncio.shield(task)

    async def _cancel(self, pending: _Pending, reason: str) -> int:
        await self.receiver.fence(pending.transfer_id)
        self._leases.drop(pending.lease)
        self.num_cancelled += 1
        self._record(pending.request_id, "reservation_cancelled", reason)
        return await self._engine.abort(pending.request_id)

    def is_cancelling(self, request_id: str) -> bool:
        """Whether a cancellation (fence, then free) of the reservation is under way."""
        return request_id in self._cancelling

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks allocated to reservations not yet handed over or cancelled."""
        return sum(p.num_blocks for p in self._pending.values())

    def _record(self, request_id: str, event: str, detail: str = "") -> None:
        if self._events is not None:
            self._events.record(request_id, event, detail)

    def has(self, request_id: str) -> bool:
        """Whether a reservation for the request is pending."""
        return request_id in self._pending

    def _destination(self, views: list[memoryview]) -> list[memoryview]:
        """Where a transfer's blocks land; the `transfer.recv_map` fault (tests only) shifts
        them one place, as a stale block table would (only the canary can notice)."""
        if self._faults is None or len(views) < 2:
            return views
        rule = self._faults.fire(FaultSite.TRANSFER_RECV_MAP)
        if rule is None or rule.action is not FaultKind.SHIFT:
            return views
        return [*views[1:], views[0]]

    async def _chunk_fault(self) -> bool:
        """The `transfer.recv_chunk` site: False (close) drops the KV connection."""
        assert self._faults is not None
        rule = self._faults.fire(FaultSite.TRANSFER_RECV_CHUNK)
        if rule is None:
            return True
        if rule.action is FaultKind.CLOSE:
            return False
        await perform(rule)
        return True

    def _verified(self, pending: _Pending) -> None:
        incoming = self.receiver.get(pending.transfer_id)
        if incoming is not None and incoming.session is not None:
            pending.value_digest = incoming.session.value_digest
            pending.transport = incoming.transport
            pending.num_bytes = incoming.plan.layout.payload_bytes
            if incoming.begin_ns is not None and incoming.verified_ns is not None:
                pending.seconds = (incoming.verified_ns - incoming.begin_ns) / 1e9
        self._record(pending.request_id, "kv_verified")
        pending.verified = True
        pending.settled.set()

    def _spawn_cancel(self, request_id: str, reason: str) -> None:
        task = asyncio.get_running_loop().create_task(self.cancel(request_id, reason))
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    async def wait_idle(self) -> None:
        """Wait for cancellations under way (for an orderly stop)."""
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._spawned, *self._cancelling.values())
