"""POST /kv_events: the worker's prefix-cache changes, streamed to every router that follows.

A stream (NDJSON, one `KVEventBatch` per line) starts where the caller left off when it can:
the same epoch and an `after_seq` the log still holds replay the missed events; otherwise it
starts with a `snapshot` (every cached hash and the event number it is current as of, read on
the engine thread between steps, so no event can fall between the two). Then each event as
the engine appends it, and a `heartbeat` after `heartbeat_s` of silence. If the stream falls
so far behind that the log dropped events it had not sent, it sends a fresh snapshot: a
follower never applies an event out of order.

Wake-ups cross threads: the log's `on_append` runs on the engine thread and only schedules a
wake-up on the event loop (at most one pending at a time); the streams themselves read the
log on the loop.

It knows the log, the engine loop and HTTP; not routers or what they do with the events.
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from pdserve.engine.engine import Engine
from pdserve.engine.kv_events import KVEventLog
from pdserve.protocol.worker_observe import KVEventBatch, KVEventsRequest
from pdserve.worker.engine_loop import EngineLoop
from pdserve.worker.http.token_stream import end_stream

NDJSON = "application/x-ndjson"
HEARTBEAT_S = 1.0


def _snapshot_of(engine: Engine) -> tuple[int, list[int]]:
    """(newest event number, cached hashes), read together on the engine thread."""
    events = engine.block_manager.events
    seq = events.last_seq if events is not None else 0
    return seq, engine.cached_block_hashes()


class KVEventStreams:
    """Serves the streams of one worker's KV event log."""

    def __init__(self, log: KVEventLog, engine: EngineLoop, heartbeat_s: float = HEARTBEAT_S):
        self.log = log
        self._engine = engine
        self._heartbeat_s = heartbeat_s
        self._loop: asyncio.AbstractEventLoop | None = None
        # One flag per open stream, set when the log may have grown.
        self._streams: set[asyncio.Event] = set()
        self._wake_pending = False
        self._closing = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start waking streams on `loop` when the engine appends an event."""
        self._loop = loop
        self.log.on_append = self._on_append

    def _on_append(self) -> None:
        # Engine thread: schedule one wake-up unless one is already on its way.
        loop = self._loop
        if loop is None or self._wake_pending:
            return
        self._wake_pending = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
            loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._wake_pending = False
        for changed in self._streams:
            changed.set()

    @property
    def num_streams(self) -> int:
        """Streams open now."""
        return len(self._streams)

    def close(self) -> None:
        """End every open stream now (the worker is stopping)."""
        self._closing = True
        self._wake()

    async def _snapshot(self, response: web.StreamResponse) -> int:
        seq, hashes = await self._engine.call(_snapshot_of)
        snapshot = KVEventBatch(epoch=self.log.epoch, seq=seq, kind="snapshot", block_hashes=hashes)
        await _write(response, snapshot)
        return seq

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """POST /kv_events KVEventsRequest -> NDJSON KVEventBatch lines, until the caller
        leaves or the worker stops."""
        body = KVEventsRequest.model_validate_json(await request.read())
        response = web.StreamResponse(headers={"Content-Type": NDJSON})
        await response.prepare(request)
        changed = asyncio.Event()
        self._streams.add(changed)
        try:
            await self._follow(response, body, changed)
        finally:
            self._streams.discard(changed)
        await end_stream(response)
        return response

    async def _follow(
        self, response: web.StreamResponse, body: KVEventsRequest, changed: asyncio.Event
    ) -> None:
        position = body.after_seq if body.epoch == self.log.epoch else None
        if position is None or self.log.since(position) is None:
            position = await self._snapshot(response)
        while not self._closing:
            # Cleared before the log is read: an append after the read sets it again.
            changed.clear()
            events = self.log.since(position)
            if events is None:  # fell behind the log's capacity
                position = await self._snapshot(response)
                continue
            for event in events:
                line = KVEventBatch(
                    epoch=self.log.epoch,
                    seq=event.seq,
                    kind=event.kind.value,
                    block_hashes=list(event.block_hashes),
                )
                await _write(response, line)
                position = event.seq
            if events:
                continue
            try:
                async with asyncio.timeout(self._heartbeat_s):
                    await changed.wait()
            except TimeoutError:
                beat = KVEventBatch(epoch=self.log.epoch, seq=position, kind="heartbeat")
                await _write(response, beat)


async def _write(response: web.StreamResponse, line: KVEventBatch) -> None:
    await response.write(line.model_dump_json().encode() + b"\n")
