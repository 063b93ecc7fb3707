"""The decode side of KV transfers: reservations, the receiver and its TCP endpoint.

Life cycle of one reservation (all on the event loop's thread):

    reserve ──► PENDING (engine: remote-KV allocation; receiver: expects the transfer id;
       │                 lease over the blocks that will be written, TTL from the request)
       ├── receiver verified the commit ──► VERIFIED ──take──► handed to the decoder
       │                                                        (lease dropped, transfer forgotten)
       └── lease expired / take timed out / cancel ──► CANCELLED (engine request aborted:
                                                       every block back in the pool)

Invariants: a request is scheduled only after `take` saw VERIFIED (invariant 2: the engine is
only told by the decoder, after take); every PENDING reservation ends in exactly one of
handed-over or cancelled, so no block outlives its lease (invariant 1). The receiver's guard
checks the lease before Begin, each Chunk and Commit, so a transfer that arrives after expiry
is refused and cannot write into freed blocks.

It knows the engine loop, the receiver and leases; not HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
from dataclasses import dataclass, field

from pdserve.errors import KVNotReady, RequestNotFound, Unauthorized
from pdserve.faults import FaultInjector, FaultKind, FaultSite, perform
from pdserve.observability.timeline_log import EventRing
from pdserve.transfer.messages import KVLayout, token_digest
from pdserve.transfer.receiver import IncomingTransfer, KVReceiver
from pdserve.transfer.receiver_session import ReceivePlan
from pdserve.transfer.sender import LeaseHandle
from pdserve.transfer.tcp import TcpServer, serve_tcp
from pdserve.worker.engine_loop import EngineInfo, EngineLoop
from pdserve.worker.lease_keeper import LeaseKeeper
from pdserve.worker.protocol import KVAbortRequest, Reservation, ReserveRequest


@dataclass(slots=True)
class _Pending:
    request_id: str
    transfer_id: bytes
    lease: LeaseHandle
    capability_token: bytes
    # Blocks allocated for the request (the reserved-blocks gauge sums them).
    num_blocks: int
    # Set once: verified, or cancelled (then `cancel_reason` says why).
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    verified: bool = False
    cancel_reason: str | None = None


class KVInbox:
    """Every reservation of one decode worker and the TCP endpoint its KV arrives on."""

    def __init__(
        self,
        engine: EngineLoop,
        info: EngineInfo,
        leases: LeaseKeeper,
        faults: FaultInjector | None = None,
        events: EventRing | None = None,
    ) -> None:
        self._engine = engine
        self._info = info
        self._leases = leases
        self._faults = faults
        # No hook at all when faults are off: the receiver's chunk path stays as it is.
        self.receiver = KVReceiver(
            info.fingerprint, on_chunk=self._chunk_fault if faults is not None else None
        )
        self._pending: dict[str, _Pending] = {}
        self._server: TcpServer | None = None
        self._advertise_host: str | None = None
        self._tasks: set[asyncio.Task[int]] = set()
        self.num_cancelled = 0
        # Timeline events (reserved, kv_verified, reservation_cancelled); None: not recorded.
        self._events = events

    async def start(self, host: str, port: int, advertise_host: str | None = None) -> str:
        """Listen on `host` for KV connections; returns the endpoint as "host:port", naming
        `advertise_host` (where other machines reach this one) instead of `host` when given."""
        self._server = await serve_tcp(self.receiver.handle, host, port)
        self._advertise_host = advertise_host
        return self.address

    @property
    def address(self) -> str:
        """ "host:port" prefill workers send KV to (after `start`). Reservations carry it to
        another machine, where a wildcard bind (0.0.0.0) would mean that machine itself."""
        assert self._server is not None, "KVInbox.start was not called"
        host, port = self._server.address
        return f"{self._advertise_host or host}:{port}"

    async def aclose(self) -> None:
        """Stop the endpoint and cancel every pending reservation."""
        if self._server is not None:
            await self._server.aclose()
        for request_id in list(self._pending):
            await self.cancel(request_id, "worker stopping")

    async def reserve(self, body: ReserveRequest) -> Reservation:
        """Allocate the blocks, expect the transfer and lease the blocks it will write."""
        rid = body.request_id
        params = body.sampling.to_params()
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
            pending = _Pending(rid, transfer_id, lease, token, len(block_ids))
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
                )
                self.receiver.expect(
                    IncomingTransfer(
                        plan,
                        views[skip:end],
                        on_verified=lambda: self._verified(pending),
                        guard=lambda: self._leases.check(lease),
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
            transfer_address=self.address,
            num_cached_tokens=num_cached,
            lease_ttl_s=body.lease_ttl_s,
        )

    async def take(self, request_id: str, timeout_s: float) -> None:
        """Wait until the reservation's KV is verified and hand it over to the caller.

        Raises RequestNotFound for an unknown reservation, KVNotReady (after cancelling it)
        when the KV is not verified in time or the reservation was cancelled meanwhile.
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
        self._pending.pop(request_id, None)
        self.receiver.forget(pending.transfer_id)
        self._leases.drop(pending.lease)

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
        """Drop a pending reservation and free its blocks; returns blocks freed (0 if none)."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return 0
        pending.cancel_reason = reason
        pending.settled.set()
        self.receiver.forget(pending.transfer_id)
        self._leases.drop(pending.lease)
        self.num_cancelled += 1
        self._record(request_id, "reservation_cancelled", reason)
        return await self._engine.abort(request_id)

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
        self._record(pending.request_id, "kv_verified")
        pending.verified = True
        pending.settled.set()

    def _spawn_cancel(self, request_id: str, reason: str) -> None:
        task = asyncio.get_running_loop().create_task(self.cancel(request_id, reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait_idle(self) -> None:
        """Wait for cancellations started by the reaper (for an orderly stop)."""
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks)
