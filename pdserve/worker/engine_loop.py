"""The engine's own thread: the only place any `Engine` method runs.

Invariant (the worker relies on it, tests check it): the engine is built, called and stepped on
one dedicated thread and nowhere else. Other threads and asyncio tasks talk to it only through
`EngineLoop`: a thread-safe command queue of callables that the engine thread runs between
steps, each answered through a future. Token output goes the other way: after each step, every
subscribed request's delta is put on that request's `asyncio.Queue` with
`loop.call_soon_threadsafe`, so the queue is only touched on its event loop.

Life cycle: `start` builds the engine on the thread and returns its static `EngineInfo`; the
thread then steps while the engine has work and blocks on the command queue while it has none
(no busy spin); `stop` queues a sentinel and joins.

Byte views returned by `kv_block_views` are used off the thread (the transfer layer reads or
writes them): that is safe because the blocks are pinned to a request that the scheduler is
not running (held prefill KV, or a remote-KV allocation).

It knows the engine and asyncio queues; not HTTP, leases or transfers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar, Unpack

from pdserve.engine.engine import Engine
from pdserve.engine.outputs import EngineStats, RequestDelta
from pdserve.engine.request import StartOptions
from pdserve.errors import NoFreeBlocks, PromptTooLong, RequestNotFound
from pdserve.faults import FaultInjector, FaultSite
from pdserve.protocol.sampling import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
DeltaQueue = asyncio.Queue[RequestDelta]
# "Nothing queued": distinct from None, which asks the thread to stop.
_EMPTY = object()


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What never changes after the engine is built (read once, on the engine thread)."""

    fingerprint: dict[str, Any]
    fingerprint_digest: str
    num_layers: int
    block_size: int
    # Bytes of one KV block across every layer (the transfer unit).
    block_bytes: int
    dtype: str
    num_blocks: int
    max_model_len: int

    def num_prompt_blocks(self, num_prompt_tokens: int) -> int:
        """Blocks that hold a prompt's KV."""
        return math.ceil(num_prompt_tokens / self.block_size)


@dataclass(slots=True)
class _Command:
    fn: Callable[[Engine], Any]
    future: concurrent.futures.Future[Any]


@dataclass(frozen=True, slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: DeltaQueue
    # Run on the engine thread right after the finishing delta is published (see `add`).
    on_finish: Callable[[Engine], None] | None = None


class EngineLoop:
    """Owns one engine on its own thread; every method here is safe from any thread."""

    def __init__(
        self, build: Callable[[], Engine], name: str = "engine", faults: FaultInjector | None = None
    ) -> None:
        self._build = build
        # The `worker.engine_step` site (tests only: an engine slower than the machine).
        self._faults = faults
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        # request id -> where its deltas go; touched on the engine thread only.
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started: concurrent.futures.Future[EngineInfo] = concurrent.futures.Future()
        # Guards `_stopped` with the queue's tail: no command is queued behind the stop.
        self._lock = threading.Lock()
        self._stopped = False
        # The engine's counts as of the end of its last command or step, written on the engine
        # thread only (one reference assignment): /health must answer while a long step (a
        # 4096-token prefill: seconds on a CPU) runs, or a busy worker looks dead.
        self._snapshot: EngineStats | None = None

    @property
    def thread_ident(self) -> int | None:
        """The engine thread's id (for the single-thread invariant's tests)."""
        return self._thread.ident

    # ---- life cycle ----------------------------------------------------------------------

    async def start(self) -> EngineInfo:
        """Start the thread, build the engine there, and return its static facts."""
        self._thread.start()
        return await asyncio.wrap_future(self._started)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop stepping and join the thread (blocking; idempotent)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ---- commands ------------------------------------------------------------------------

    async def call(
        self, fn: Callable[[Engine], T], undo: Callable[[Engine], object] | None = None
    ) -> T:
        """Run `fn(engine)` on the engine thread between steps; its result or exception.

        If the caller is cancelled once `fn` has started, `fn` still completes; `undo(engine)`
        then runs after it (only if it succeeded), so a command that creates state (a request,
        an allocation) leaks nothing when its waiter goes away at the wrong moment."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._stopped:
                raise RuntimeError("the engine thread has stopped")
            self._commands.put(_Command(fn, future))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # wrap_future cancelled `future`; that fails once the engine thread took it up.
            if undo is not None and not future.cancelled():
                self._queue_undo(future, undo)
            raise

    def _queue_undo(
        self, done: concurrent.futures.Future[Any], undo: Callable[[Engine], object]
    ) -> None:
        def run(engine: Engine) -> None:
            # Commands run in order: `done`'s command has finished by now.
            if not done.cancelled() and done.exception() is None:
                undo(engine)

        with self._lock:
            if not self._stopped:
                self._commands.put(_Command(run, concurrent.futures.Future()))

    async def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        on_finish: Callable[[Engine], None] | None = None,
        **start: Unpack[StartOptions],
    ) -> DeltaQueue:
        """Queue a request (resuming after `output_token_ids` if given); its deltas arrive on
        the returned queue until one is finished.

        `on_finish(engine)` runs on the engine thread just after the step that finished the
        request, before any other step or command: the way to read KV it holds (and run the
        canary's forward) without queueing behind the next, perhaps long, prefill step. It
        reports its own results (a future); an exception it raises is logged."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), on_finish)

        def add(engine: Engine) -> None:
            engine.add_request(request_id, prompt_token_ids, params, **start)
            self._streams[request_id] = stream

        await self.call(add, undo=self._aborter(request_id))
        return stream.queue

    async def add_remote(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> tuple[int, list[int], list[memoryview]]:
        """Allocate blocks for remote KV: (num cached tokens, block ids, block views)."""

        def add_remote(engine: Engine) -> tuple[int, list[int], list[memoryview]]:
            try:
                num_cached = engine.add_remote_request(request_id, prompt_token_ids, params)
            except PromptTooLong:
                bm = engine.block_manager
                need = bm.num_blocks_needed(len(prompt_token_ids) + params.max_tokens)
                if prompt_token_ids and need <= bm.num_blocks:
                    # It would fit an emptier cache: out of blocks now, not too long.
                    raise NoFreeBlocks(
                        f"request {request_id}: {bm.num_blocks_needed(len(prompt_token_ids) + 1)}"
                        f" KV blocks needed, {bm.num_free_blocks} free"
                    ) from None
                raise
            return num_cached, engine.block_ids(request_id), engine.kv_block_views(request_id)

        return await self.call(add_remote, undo=self._aborter(request_id))

    async def mark_ready(
        self,
        request_id: str,
        first_token_id: int,
        check: Callable[[Engine], object] | None = None,
    ) -> DeltaQueue:
        """Schedule a request whose remote KV is verified; deltas follow from the 2nd token.

        `check(engine)` runs first, in the same command (the KV canary: one wait for the
        engine thread, not two); if it raises, nothing is scheduled and the error is raised.
        If the first token already ends the request (a stop token, max_tokens 1, a grammar it
        completes), the request is dropped and the queue gets one finished delta, no tokens.
        """
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())

        def mark(engine: Engine) -> None:
            if check is not None:
                check(engine)
            reason = engine.first_token_finishes(request_id, first_token_id)
            if reason is not None:
                engine.abort(request_id)
                self._publish(stream, RequestDelta(request_id, (), True, reason))
                return
            engine.mark_remote_kv_ready(request_id, first_token_id)
            self._streams[request_id] = stream

        await self.call(mark)
        return stream.queue

    async def abort(self, request_id: str) -> int:
        """Stop the request wherever it is; returns the blocks it held (0 if unknown)."""
        return await self.call(self._aborter(request_id))

    def _aborter(self, request_id: str) -> Callable[[Engine], int]:
        """An engine command that aborts the request (and ends its stream): blocks freed."""

        def abort(engine: Engine) -> int:
            try:
                num_blocks = len(engine.block_ids(request_id))
                engine.abort(request_id)
            except RequestNotFound:
                num_blocks = 0
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                self._publish(stream, RequestDelta(request_id, (), True, "abort"))
            return num_blocks

        return abort

    async def release(self, request_id: str) -> int:
        """Free KV a finished request held for a transfer; returns blocks freed (0 if none)."""

        def release(engine: Engine) -> int:
            try:
                return engine.release(request_id)
            except RequestNotFound:
                return 0

        return await self.call(release)

    async def stats(self) -> EngineStats:
        """Block and queue counts as of the engine's last command or step, without waiting
        for a step in progress (exact whenever the engine is between steps)."""
        with self._lock:
            if self._stopped or self._snapshot is None:
                raise RuntimeError("the engine thread has stopped")
            return self._snapshot

    async def kv_block_views(self, request_id: str) -> list[memoryview]:
        """The request's blocks as byte views (see the module docstring on their use)."""
        return await self.call(lambda engine: engine.kv_block_views(request_id))

    # ---- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._build()
            info = _info_of(engine)
        except BaseException as exc:
            self._started.set_exception(exc)
            return
        self._snapshot = engine.stats()
        self._started.set_result(info)
        while True:
            # Block only when a step would do nothing: idle costs no CPU.
            item = self._commands.get() if not engine.has_work() else self._next_nowait()
            while item is not _EMPTY:
                if not isinstance(item, _Command):
                    self._fail_pending()
                    return  # None: stop
                self._run_command(engine, item)
                item = self._next_nowait()
            if engine.has_work():
                self._step(engine)

    def _next_nowait(self) -> _Command | object | None:
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return _EMPTY

    def _fail_pending(self) -> None:
        # Callers awaiting commands queued behind the stop must not wait forever.
        while (item := self._next_nowait()) is not _EMPTY:
            if isinstance(item, _Command) and item.future.set_running_or_notify_cancel():
                item.future.set_exception(RuntimeError("the engine thread has stopped"))

    def _run_command(self, engine: Engine, command: _Command) -> None:
        if not command.future.set_running_or_notify_cancel():
            return
        try:
            result = command.fn(engine)
        except BaseException as exc:
            self._snapshot = engine.stats()
            command.future.set_exception(exc)
        else:
            # Before the answer: whoever awaited the command then sees its effect in `stats`.
            self._snapshot = engine.stats()
            command.future.set_result(result)

    def _step(self, engine: Engine) -> None:
        try:
            deltas = engine.step()
        except Exception:
            # A failed step leaves no request in a known state: fail and free every one.
            logger.exception("engine step failed")
            for request_id, failed in list(self._streams.items()):
                self._publish(failed, RequestDelta(request_id, (), True, "error"))
                with contextlib.suppress(RequestNotFound):
                    engine.abort(request_id)
            self._streams.clear()
            self._snapshot = engine.stats()
            return
        self._snapshot = engine.stats()
        if deltas and self._faults is not None:
            rule = self._faults.fire(FaultSite.WORKER_ENGINE_STEP)
            if rule is not None:
                time.sleep(rule.delay_s)  # the engine thread's own pace: nothing else waits
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            if delta.finished:
                del self._streams[delta.request_id]
            self._publish(stream, delta)
            if delta.finished and stream.on_finish is not None:
                try:
                    stream.on_finish(engine)
                except Exception:
                    logger.exception("finish hook of %s failed", delta.request_id)
                self._snapshot = engine.stats()

    @staticmethod
    def _publish(stream: _Stream, delta: RequestDelta) -> None:
        # RuntimeError: the event loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)


def _info_of(engine: Engine) -> EngineInfo:
    fp = engine.model.fingerprint
    return EngineInfo(
        fingerprint=asdict(fp),
        fingerprint_digest=fp.digest,
        num_layers=engine.model.config.num_layers,
        block_size=engine.config.block_size,
        block_bytes=engine.kv_cache.block_bytes,
        dtype=engine.model.dtype,
        num_blocks=engine.block_manager.num_blocks,
        max_model_len=engine.max_model_len,
    )
