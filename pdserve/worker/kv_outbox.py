"""The prefill side of KV transfers: push a finished prefill's held KV to its reservation.

Life cycle of one send (a background task per request, on the event loop's thread):

    start ──► lease granted on the held blocks (TTL from the request)
          ──► send_with_retries over TCP to the reservation's endpoint
          ──► Ack: sent / fatal error or retries spent: failed / lease expired: cancelled
          ──► always: the engine releases the held KV

Invariant 1 (no orphan KV): whatever ends the send, its `finally` drops the lease and releases
the engine's held blocks; lease expiry cancels the task, which reaches the same `finally`.
Only the blocks after the decode side's cached prefix travel (`num_cached_tokens` of the
reservation, rounded down to whole blocks).

It knows the engine loop, the sender and leases; not HTTP or the decode side's internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdserve.errors import ConfigError
from pdserve.faults import FaultInjector
from pdserve.observability.timeline_log import EventRing
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
from pdserve.transfer.tcp import open_tcp_stream
from pdserve.worker.engine_loop import EngineInfo, EngineLoop
from pdserve.worker.lease_keeper import LeaseKeeper
from pdserve.worker.metrics import SendHistograms
from pdserve.worker.protocol import Reservation

logger = logging.getLogger(__name__)


# (request id, destination, reason): tell the decode side its KV will not come.
GiveUpNotice = Callable[[str, "Destination", str], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Destination:
    """A reservation, parsed and checked before any prefill is spent on it."""

    transfer_id: bytes
    capability_token: bytes
    address: Address
    num_cached_tokens: int
    # The decode worker's control URL, told when the send is given up; None: nobody is told
    # (its reservation then lapses with its lease).
    decode_url: str | None = None

    @classmethod
    def parse(cls, reservation: Reservation, decode_url: str | None = None) -> Destination:
        """Raise ConfigError naming the bad reservation field."""
        fields: dict[str, bytes] = {}
        for name in ("transfer_id", "capability_token"):
            try:
                fields[name] = bytes.fromhex(getattr(reservation, name))
            except ValueError:
                raise ConfigError(f"reservation.{name}: not hex") from None
            if len(fields[name]) != 16:
                raise ConfigError(f"reservation.{name}: must be 16 bytes")
        host, sep, port = reservation.transfer_address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"reservation.transfer_address: {reservation.transfer_address!r} is not host:port"
            )
        if reservation.num_cached_tokens < 0:
            raise ConfigError("reservation.num_cached_tokens: must be >= 0")
        return cls(
            fields["transfer_id"],
            fields["capability_token"],
            (host, int(port)),
            reservation.num_cached_tokens,
            decode_url,
        )


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
    ) -> None:
        self._engine = engine
        self._info = info
        self._leases = leases
        self._policy = policy or SendPolicy()
        # The `transfer.send` site: every KV stream is wrapped only when faults are on.
        self._faults = faults
        # Tells the decode side a send was given up (best effort; its lease is the backstop).
        self._give_up = give_up
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.num_sent = 0
        self.num_failed = 0
        # Attempts after the first, over every acknowledged send.
        self.num_send_retries = 0
        self.sends = SendHistograms()
        # Timeline events (kv_send_start, kv_send_acked, kv_send_failed); None: not recorded.
        self._events = events

    def start(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        blocks: list[memoryview],
        block_ids: list[int],
        destination: Destination,
        lease_ttl_s: float,
    ) -> None:
        """Start sending the request's held KV; the engine's KV is released when it ends."""
        info = self._info
        skip = destination.num_cached_tokens // info.block_size
        end = info.num_prompt_blocks(len(prompt_token_ids))
        task = asyncio.get_running_loop().create_task(
            self._send(
                request_id,
                prompt_token_ids,
                blocks[skip:end],
                block_ids[skip:end],
                destination,
                lease_ttl_s,
            )
        )
        self._tasks[request_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(request_id, None))

    def cancel(self, request_id: str) -> bool:
        """Stop the request's send (its KV is then released); False if none runs."""
        task = self._tasks.get(request_id)
        if task is None:
            return False
        task.cancel()
        return True

    async def aclose(self) -> None:
        """Cancel every send and wait until their KV is released."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _record(self, request_id: str, event: str, detail: str) -> None:
        if self._events is not None:
            self._events.record(request_id, event, detail)

    @property
    def num_in_flight(self) -> int:
        return len(self._tasks)

    async def _send(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        blocks: list[memoryview],
        block_ids: list[int],
        destination: Destination,
        lease_ttl_s: float,
    ) -> None:
        lease: LeaseHandle | None = None
        try:
            if not blocks:
                return  # the decode side had the whole prompt cached
            task = asyncio.current_task()
            assert task is not None
            lease = self._leases.grant(block_ids, lease_ttl_s, f"prefill {request_id}", task.cancel)
            info = self._info
            layout = KVLayout(
                info.num_layers, len(blocks), info.block_bytes, info.dtype, info.block_size
            )
            transfer = OutgoingTransfer(
                destination.transfer_id,
                request_id,
                1,
                layout,
                len(prompt_token_ids),
                token_digest(prompt_token_ids),
                destination.capability_token,
                blocks,
            )
            session = SenderSession(destination.transfer_id, info.fingerprint)

            faults = self._faults

            async def connect() -> ByteStream:
                stream = await open_tcp_stream(destination.address)
                return stream if faults is None else InjectorStream(stream, faults)

            num_bytes = sum(view.nbytes for view in blocks)
            self._record(request_id, "kv_send_start", f"blocks={len(blocks)} bytes={num_bytes}")
            started = time.monotonic()
            report = await send_with_retries(
                connect,
                session,
                transfer,
                self._policy,
                deadline=self._leases.clock.now() + lease_ttl_s,
                lease=lease,
                clock=self._leases.clock,
            )
            self.num_sent += 1
            self.num_send_retries += report.attempts - 1
            self.sends.observe(time.monotonic() - started, num_bytes)
            self._record(
                request_id,
                "kv_send_acked",
                f"attempts={report.attempts} bytes={num_bytes}"
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
