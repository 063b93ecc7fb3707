"""POST /prefill: one prompt's prefill, its first token, and its KV handed to the outbox.

Split from the worker's API (`app.py`) because it is the prefill side's whole job: check the
reservation before anything runs, prefill holding the KV, take the value digest on the engine
thread, and hand the held KV to the outbox (which always releases it) or free it at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import TypeVar

from aiohttp import web

from pdserve.engine.engine import Engine
from pdserve.errors import ConfigError, DeadlineExceeded, EngineError
from pdserve.faults import FaultInjector, FaultSite, perform
from pdserve.observability.timeline_log import EventRing
from pdserve.protocol.worker_api import (
    LogprobModel,
    PrefillRequest,
    PrefillResult,
    SignedReservation,
    Transport,
)
from pdserve.worker.config import WorkerConfig
from pdserve.worker.engine_loop import EngineLoop
from pdserve.worker.http.bodies import json_body, parse_body
from pdserve.worker.kv import canary as kv_canary
from pdserve.worker.kv.outbox import Destination, HeldSend, KVOutbox, parse_destination

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Prefills:
    """The prefill handler of one worker; `admitted` counts a request in the engine (or refuses)."""

    config: WorkerConfig
    engine: EngineLoop
    events: EventRing
    faults: FaultInjector | None
    # KV transports this worker can send over, best first.
    local_transports: tuple[Transport, ...]
    admitted: Callable[[str], contextlib.AbstractContextManager[None]]

    def destination(self, signed: SignedReservation) -> Destination:
        """Where a reservation the router signed points, checked as every send's is (its
        signature, expiry, and a transport both sides have), before anything is spent."""
        return parse_destination(
            signed,
            key=self.config.reservation_key,
            now_s=time.time(),
            local=self.local_transports,
            explicit=self.config.kv_transport != "auto",
        )

    async def handle(self, request: web.Request, outbox: KVOutbox) -> web.Response:
        """POST /prefill PrefillRequest -> PrefillResult; the KV send continues after."""
        body = await parse_body(request, PrefillRequest)
        rid = body.request_id
        destination = None
        if body.reservation is not None:
            # Before any prefill: a forged, expired or unreachable reservation costs nothing.
            destination = self.destination(body.reservation)
            n, m = destination.num_cached_tokens, len(body.prompt_token_ids)
            if n > m:
                # Nothing would be sent, and the decode side would wait out its KV timeout.
                raise ConfigError(
                    f"reservation.num_cached_tokens: {n} exceeds the prompt's {m} tokens"
                )
        with self.admitted(rid):
            if destination is not None:
                outbox.warm(destination)  # the connection comes up while the prompt computes
            return await self._prefill(body, destination, outbox)

    async def _prefill(
        self, body: PrefillRequest, destination: Destination | None, outbox: KVOutbox
    ) -> web.Response:
        rid = body.request_id
        params = body.sampling
        if self.faults is not None and (rule := self.faults.fire(FaultSite.WORKER_PREFILL)):
            await perform(rule)
        start_ns = self.events.record(rid, "prefill_start").monotonic_ns
        # One token, sampled with the request's own params (seed included): the sampler keys
        # token 0's randomness by (seed, 0), so it is the token a colocated run draws.
        # min_tokens capped at 1 masks token 0's stop tokens exactly as min_tokens >= 1 does.
        first_only = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        # Read on the engine thread in the step that finishes the prefill: a command would
        # wait behind the next step (another prompt's prefill, maybe hundreds of ms) and so
        # would the decode side's first token. The digest is taken before the KV leaves this
        # thread's hands: whatever damages the held KV later (before its checksums are
        # taken) is caught by value. The first token does not wait for the digest's forward.
        held: concurrent.futures.Future[tuple[list[memoryview], list[int], int]]
        held = concurrent.futures.Future()
        digest: concurrent.futures.Future[bytes] = concurrent.futures.Future()
        want_digest = destination is not None and self.config.kv_canary

        def on_finish(engine: Engine) -> None:
            _settle(held, lambda: _held_kv(rid)(engine))
            if want_digest and not held.cancelled() and held.exception() is None:
                _settle(digest, lambda: kv_canary.digest_now(engine, rid))

        queue = await self.engine.add(
            rid, body.prompt_token_ids, first_only, hold_kv=True, on_finish=on_finish
        )
        handed_over = False
        try:
            try:
                async with asyncio.timeout(body.deadline_s):
                    delta = await queue.get()
            except TimeoutError:
                raise DeadlineExceeded(
                    f"request {rid}: prefill not done within its {body.deadline_s} s deadline"
                ) from None
            if not delta.new_token_ids:
                raise EngineError(
                    f"request {rid}: prefill ended without a token ({delta.finish_reason})"
                )
            end_ns = self.events.record(rid, "prefill_end").monotonic_ns
            views, block_ids, num_cached = await asyncio.wrap_future(held)
            if destination is not None:
                # Awaited by the send (before its first byte), not here.
                value_digest: bytes | asyncio.Future[bytes] = (
                    asyncio.wrap_future(digest) if want_digest else b""
                )
                outbox.start(
                    HeldSend(
                        rid,
                        body.prompt_token_ids,
                        views,
                        block_ids,
                        destination,
                        body.lease_ttl_s,
                        value_digest,
                    )
                )
                handed_over = True
        finally:
            if not handed_over:
                await self.engine.abort(rid)  # frees held KV too: nothing to send it to
        if self.faults is not None and (rule := self.faults.fire(FaultSite.WORKER_PREFILL_REPLY)):
            await perform(rule)
        return json_body(
            PrefillResult(
                request_id=rid,
                first_token_id=delta.new_token_ids[0],
                num_prompt_tokens=len(body.prompt_token_ids),
                num_cached_tokens=num_cached,
                prefill_start_ns=start_ns,
                prefill_end_ns=end_ns,
                first_logprobs=LogprobModel.of(delta.logprobs[0]) if delta.logprobs else None,
                prompt_logprobs=None
                if delta.prompt_logprobs is None
                else [LogprobModel.of(lp) for lp in delta.prompt_logprobs],
            )
        )


def _settle(future: concurrent.futures.Future[T], fn: Callable[[], T]) -> None:
    """Resolve `future` with what `fn` returns or raises (unless its waiter cancelled it:
    then `fn` does not run)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except Exception as exc:
        future.set_exception(exc)


def _held_kv(request_id: str) -> Callable[[Engine], tuple[list[memoryview], list[int], int]]:
    """An engine command reading a finished prefill's held KV: (views, block ids, cached)."""

    def read(engine: Engine) -> tuple[list[memoryview], list[int], int]:
        held = engine.get_request(request_id)
        ids = engine.block_ids(request_id)
        return engine.kv_block_views(request_id), ids, held.num_cached_tokens

    return read
