"""A worker's token streams: NDJSON `TokenEvent` lines written as the engine produces tokens.

Every streamed endpoint (/decode, /generate) writes through `TokenStreamer`: one line per
engine delta, a `finished` line at the end, and, when the request's deadline passes first, the
request aborted in the engine and an error line (`DeadlineExceeded`) instead of silence. The
`worker.decode_tokens` fault site lives here (tests only). Timeline events `first_token` and
`finished` are recorded as the lines go out.

It knows aiohttp responses, the protocol's `TokenEvent` and the engine loop's queues.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from aiohttp import web

from pdserve.engine.outputs import RequestDelta
from pdserve.errors import DeadlineExceeded, PdserveError
from pdserve.faults import FaultInjector, FaultSite, perform
from pdserve.observability.timeline_log import EventRing
from pdserve.protocol.worker_api import LogprobModel, TokenEvent
from pdserve.worker.engine_loop import DeltaQueue, EngineLoop
from pdserve.worker.step_report import step_info

NDJSON = "application/x-ndjson"


async def end_stream(response: web.StreamResponse) -> None:
    """End a streamed response. A reader that hung up once it had the last event (the router
    closes a finished stream) is not an error: nothing it wanted is lost."""
    with contextlib.suppress(ConnectionResetError):
        await response.write_eof()


class TokenStreamer:
    """Writes token streams for one worker."""

    def __init__(
        self, engine: EngineLoop, events: EventRing, faults: FaultInjector | None = None
    ) -> None:
        self._engine = engine
        self._events = events
        self._faults = faults

    async def open(self, request: web.Request) -> web.StreamResponse:
        """Send the headers of an NDJSON stream."""
        response = web.StreamResponse(headers={"Content-Type": NDJSON})
        await response.prepare(request)
        return response

    async def write(self, response: web.StreamResponse, event: TokenEvent) -> None:
        """One line."""
        await response.write(event.model_dump_json().encode() + b"\n")

    async def error(self, response: web.StreamResponse, exc: PdserveError) -> None:
        """The stream's last line: the request failed with `exc` (its class named)."""
        event = TokenEvent(
            token_ids=[],
            finished=True,
            finish_reason="error",
            error=f"{type(exc).__name__}: {exc}",
            error_type=type(exc).__name__,
        )
        await self.write(response, event)

    async def stream(
        self,
        queue: DeltaQueue,
        response: web.StreamResponse,
        request_id: str,
        deadline_s: float | None = None,
        on_delta: Callable[[RequestDelta], object] | None = None,
    ) -> None:
        """Stream the request's tokens; at its deadline, abort it and end with an error line.
        `on_delta` sees every delta first (the request's checkpoint replica)."""
        try:
            async with asyncio.timeout(deadline_s):
                await self._stream(queue, response, request_id, on_delta)
        except TimeoutError:
            await self._engine.abort(request_id)
            await self.error(
                response,
                DeadlineExceeded(f"request {request_id}: past its {deadline_s} s deadline"),
            )

    async def _stream(
        self,
        queue: DeltaQueue,
        response: web.StreamResponse,
        request_id: str,
        on_delta: Callable[[RequestDelta], object] | None,
    ) -> None:
        first = True
        while True:
            delta = await queue.get()
            if on_delta is not None:
                on_delta(delta)
            if first and delta.new_token_ids:
                first = False
                self._events.record(request_id, "first_token")
            if delta.finished:
                self._events.record(request_id, "finished", delta.finish_reason or "")
            token_ids = list(delta.new_token_ids)
            logprobs = [LogprobModel.of(lp) for lp in delta.logprobs]
            if self._faults is not None:
                token_ids, logprobs = await self._token_faults(token_ids, logprobs, response)
            failed = delta.finish_reason == "error"
            event = TokenEvent(
                token_ids=token_ids,
                finished=delta.finished,
                finish_reason=delta.finish_reason,
                error="the engine failed this request" if failed else None,
                error_type="EngineError" if failed else None,
                logprobs=logprobs or None,
                prompt_logprobs=None
                if delta.prompt_logprobs is None
                else [LogprobModel.of(lp) for lp in delta.prompt_logprobs],
                num_cached_tokens=delta.num_cached_tokens if delta.new_token_ids else None,
                step=step_info(delta),
            )
            await self.write(response, event)
            if delta.finished:
                return

    async def _token_faults(
        self, token_ids: list[int], logprobs: list[LogprobModel], response: web.StreamResponse
    ) -> tuple[list[int], list[LogprobModel]]:
        """The `worker.decode_tokens` site, one hit per token, fired before the token is
        written: tokens ahead of a firing go out first. Returns the tokens still to write (and
        their logprobs, if any)."""
        assert self._faults is not None
        written = 0
        for i in range(len(token_ids)):
            rule = self._faults.fire(FaultSite.WORKER_DECODE_TOKENS)
            if rule is None:
                continue
            if i > written:
                event = TokenEvent(
                    token_ids=token_ids[written:i], logprobs=logprobs[written:i] or None
                )
                await self.write(response, event)
                written = i
            await perform(rule)
        return token_ids[written:], logprobs[written:]
