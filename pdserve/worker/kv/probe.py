"""The pair probe: throwaway KV, sent and timed over the path a handoff between the same two
workers would take, so that a slow or silently downgraded pair is known before a request
pays for it (vllm#52607: NIXL falling back to TCP at 1% of its rate, unseen, with 200s).

The router runs it when a prefill or decode worker joins (or restarts): it asks the decode
side to expect `num_bytes` (`ProbeSink.expect`: a reservation like any other, its blocks
scratch memory, not engine blocks, and its lease `ttl_s`), signs that reservation as it signs
a handoff's, and has the prefill side send to it (`KVOutbox.probe`): the same transport choice,
connection pool (the probe warms the stream later handoffs reuse), session, checksums and
commit as a handoff. Both sides count the transfer in their `TransportStats`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from collections.abc import Callable, Coroutine
from typing import Any

from pdserve.protocol.worker_api import KVEndpoint, ProbeExpectRequest, Reservation
from pdserve.transfer.messages import KVLayout
from pdserve.transfer.receiver import IncomingTransfer, KVReceiver
from pdserve.transfer.receiver_session import ReceivePlan
from pdserve.worker.engine_loop import EngineInfo
from pdserve.worker.kv.transport_stats import TransportStats

PROBE_PREFIX = "probe-"


def probe_blocks(info: EngineInfo, num_bytes: int) -> int:
    """Blocks of this engine's layout a probe of `num_bytes` moves (both sides agree: their
    fingerprints, so their block sizes, match)."""
    return max(1, math.ceil(num_bytes / info.block_bytes))


class ProbeSink:
    """The decode side: each probe expected lands in scratch memory of its own, dropped
    when it is verified or its reservation's TTL passes."""

    def __init__(
        self,
        receiver: KVReceiver,
        info: EngineInfo,
        endpoints: Callable[[], list[KVEndpoint]],
        stats: TransportStats,
    ) -> None:
        self._receiver = receiver
        self._info = info
        self._endpoints = endpoints
        self._stats = stats
        self._tasks: set[asyncio.Task[None]] = set()
        self.num_expected = 0
        self.num_verified = 0

    def expect(self, body: ProbeExpectRequest) -> Reservation:
        """A probe reservation: the receiver expects its transfer until `body.ttl_s` passes."""
        info = self._info
        num_blocks = probe_blocks(info, body.num_bytes)
        scratch = memoryview(bytearray(num_blocks * info.block_bytes))
        views = [
            scratch[i * info.block_bytes : (i + 1) * info.block_bytes] for i in range(num_blocks)
        ]
        transfer_id, token = os.urandom(16), os.urandom(16)
        layout = KVLayout(
            info.num_layers, num_blocks, info.block_bytes, info.dtype, info.block_size
        )
        incoming: IncomingTransfer

        def verified() -> None:
            self.num_verified += 1
            if incoming.begin_ns is not None and incoming.verified_ns is not None:
                seconds = (incoming.verified_ns - incoming.begin_ns) / 1e9
                self._stats.probed(incoming.transport, "", layout.payload_bytes, seconds)
            self._spawn(self._drop(transfer_id, 0.0))

        incoming = IncomingTransfer(ReceivePlan(transfer_id, token, layout), views, verified)
        self._receiver.expect(incoming)
        self.num_expected += 1
        self._spawn(self._drop(transfer_id, body.ttl_s))
        return Reservation(
            request_id=f"{PROBE_PREFIX}{transfer_id.hex()[:12]}",
            transfer_id=transfer_id.hex(),
            capability_token=token.hex(),
            endpoints=self._endpoints(),
            lease_epoch=0,
            num_cached_tokens=0,
            lease_ttl_s=body.ttl_s,
            instance_id=self._receiver.instance.hex(),
        )

    async def _drop(self, transfer_id: bytes, after_s: float) -> None:
        await asyncio.sleep(after_s)
        # Fenced: a sender still writing is cut before the scratch memory is let go.
        await self._receiver.fence(transfer_id)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Drop every probe still expected."""
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)
