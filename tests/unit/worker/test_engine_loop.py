"""EngineLoop without HTTP: token events arrive in order and equal a direct engine run, aborts
free blocks, capacity refusals are typed, the idle thread blocks, and no engine attribute is
ever touched off the engine thread."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
from waiting import until

from pdserve.config import EngineConfig, ModelLoadConfig
from pdserve.engine.engine import Engine
from pdserve.engine.outputs import RequestDelta
from pdserve.errors import NoFreeBlocks, PromptTooLong
from pdserve.model.loader import LoadedModel, load_model
from pdserve.protocol.sampling import SamplingParams
from pdserve.worker.engine_loop import DeltaQueue, EngineLoop

T = TypeVar("T")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model_path: Path) -> LoadedModel:
    return load_model(str(tiny_model_path))


def make_engine(model: LoadedModel, num_blocks: int = 64) -> Engine:
    config = EngineConfig(model=ModelLoadConfig(path=str(model.path)), num_blocks=num_blocks)
    return Engine(model, config)


class ThreadCheckedEngine:
    """Records the thread of every attribute access on the wrapped engine."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.threads: set[int] = set()
        self.num_has_work_calls = 0

    def __getattr__(self, name: str) -> Any:
        self.threads.add(threading.get_ident())
        if name == "has_work":
            self.num_has_work_calls += 1
        return getattr(self._engine, name)


def with_loop(
    model: LoadedModel, body: Callable[[EngineLoop, ThreadCheckedEngine], Awaitable[T]]
) -> T:
    checked = ThreadCheckedEngine(make_engine(model))
    loop = EngineLoop(lambda: cast(Engine, checked))

    async def run() -> T:
        await loop.start()
        try:
            return await body(loop, checked)
        finally:
            loop.stop()

    result = asyncio.run(run())
    assert checked.threads == {loop.thread_ident}, "an engine attribute was touched off-thread"
    return result


async def collect(queue: DeltaQueue) -> list[RequestDelta]:
    deltas = []
    while True:
        delta = await asyncio.wait_for(queue.get(), 10)
        deltas.append(delta)
        if delta.finished:
            return deltas


def direct(model: LoadedModel, prompt: list[int], params: SamplingParams) -> list[int]:
    engine = make_engine(model)
    request = engine.add_request("d", prompt, params)
    while engine.has_unfinished():
        engine.step()
    return list(request.output_token_ids)


def test_token_events_arrive_in_order_and_equal_a_direct_run(model: LoadedModel) -> None:
    prompts = [[5, 6, 7, 8, 9], list(range(10, 40))]

    async def body(loop: EngineLoop, _: ThreadCheckedEngine) -> list[list[RequestDelta]]:
        queues = [await loop.add(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
        return list(await asyncio.gather(*(collect(q) for q in queues)))

    streams = with_loop(model, body)
    for prompt, deltas in zip(prompts, streams, strict=True):
        assert [t for d in deltas for t in d.new_token_ids] == direct(model, prompt, GREEDY)
        assert [d.finished for d in deltas] == [False] * 5 + [True]
        assert deltas[-1].finish_reason == "length"


def test_abort_ends_the_stream_and_frees_every_block(model: LoadedModel) -> None:
    async def body(loop: EngineLoop, _: ThreadCheckedEngine) -> tuple[int, list[RequestDelta]]:
        long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        queue = await loop.add("a", list(range(3, 40)), long)
        await asyncio.wait_for(queue.get(), 10)  # running
        num_blocks = await loop.abort("a")
        deltas = await collect(queue)
        stats = await loop.stats()
        assert (stats.num_free_blocks, stats.num_held_blocks) == (stats.num_blocks, 0)
        assert await loop.abort("a") == 0  # unknown now: nothing to free
        return num_blocks, deltas

    num_blocks, deltas = with_loop(model, body)
    assert num_blocks >= 3
    assert deltas[-1].finished and deltas[-1].finish_reason == "abort"


def test_held_kv_is_pinned_until_release(model: LoadedModel) -> None:
    async def body(loop: EngineLoop, _: ThreadCheckedEngine) -> None:
        one = SamplingParams(max_tokens=1, temperature=0.0)
        queue = await loop.add("p", list(range(3, 38)), one, hold_kv=True)
        (delta,) = await collect(queue)
        assert len(delta.new_token_ids) == 1
        assert (await loop.stats()).num_held_blocks == 3  # ceil(35 / 16)
        assert len(await loop.kv_block_views("p")) == 3
        assert await loop.release("p") == 3
        assert (await loop.stats()).num_held_blocks == 0

    with_loop(model, body)


def test_remote_request_refused_for_capacity_and_stopped_by_first_token(
    model: LoadedModel,
) -> None:
    async def body(loop: EngineLoop, _: ThreadCheckedEngine) -> None:
        with pytest.raises(PromptTooLong):  # never fits: 64 blocks of 16 tokens
            await loop.add_remote("huge", list(range(3, 1100)), GREEDY)
        num_cached, ids, views = await loop.add_remote("a", list(range(3, 900)), GREEDY)
        assert (num_cached, len(ids), len(views)) == (0, 57, 57)  # ceil(898 / 16)
        with pytest.raises(NoFreeBlocks, match="KV blocks needed"):
            await loop.add_remote("b", list(range(3, 300)), GREEDY)
        # max_tokens 1: the prefill's token was the whole output; nothing is scheduled.
        await loop.add_remote("c", [4, 5, 6], SamplingParams(max_tokens=1))
        (delta,) = await collect(await loop.mark_ready("c", 7))
        assert (delta.new_token_ids, delta.finish_reason) == ((), "length")
        assert await loop.abort("a") == 57
        stats = await loop.stats()
        assert (stats.num_free_blocks, stats.num_held_blocks) == (stats.num_blocks, 0)

    with_loop(model, body)


class WatchedCommands:
    """The engine loop's command queue, recording whether its thread waits in a blocking
    `get` with no timeout: the only way it may wait while idle (no polling, no spinning)."""

    def __init__(self, commands: queue.SimpleQueue[Any]) -> None:
        self._commands = commands
        self.waiting = threading.Event()
        self.timeouts: list[float | None] = []

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        self.timeouts.append(timeout)
        if block and timeout is None:
            self.waiting.set()
        try:
            return self._commands.get(block, timeout)
        finally:
            self.waiting.clear()

    def get_nowait(self) -> Any:
        return self._commands.get_nowait()

    def put(self, item: Any) -> None:
        self._commands.put(item)


def test_idle_thread_blocks_on_the_queue(model: LoadedModel) -> None:
    async def body(loop: EngineLoop, checked: ThreadCheckedEngine) -> None:
        watched = WatchedCommands(loop._commands)
        loop._commands = cast(Any, watched)
        await collect(await loop.add("r", [5, 6, 7], GREEDY))
        await loop.stats()
        # Idle now: the thread ends its turn and waits for the next command, however long.
        await until(watched.waiting.is_set, what="the idle engine thread waits on its queue")
        before = checked.num_has_work_calls
        assert watched.timeouts and set(watched.timeouts) == {None}  # never a polling wait
        await loop.call(lambda _: None)  # a command wakes it for one turn, then it waits again
        await until(watched.waiting.is_set, what="the engine thread waits again")
        assert checked.num_has_work_calls - before <= 2

    with_loop(model, body)


def test_stop_fails_commands_queued_behind_it(model: LoadedModel) -> None:
    loop = EngineLoop(lambda: make_engine(model))

    async def run() -> None:
        await loop.start()
        loop.stop()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="stopped"):
            await asyncio.wait_for(loop.stats(), 2)
        assert time.monotonic() - start < 2

    asyncio.run(run())


def test_stats_answer_while_a_long_step_runs(model: LoadedModel) -> None:
    """A worker's /health reads `stats`: a multi-second step must not make it look dead."""
    in_step, release = threading.Event(), threading.Event()

    class SlowEngine(ThreadCheckedEngine):
        def __getattr__(self, name: str) -> Any:
            attr = super().__getattr__(name)
            if name != "step":
                return attr

            def step() -> Any:
                in_step.set()
                release.wait(10)
                return attr()

            return step

    slow = SlowEngine(make_engine(model))
    loop = EngineLoop(lambda: cast(Engine, slow))

    async def run() -> None:
        await loop.start()
        try:
            queue = await loop.add("r", [5, 6, 7], GREEDY)
            assert await asyncio.to_thread(in_step.wait, 10)
            started = time.monotonic()
            stats = await asyncio.wait_for(loop.stats(), 2)
            assert time.monotonic() - started < 1.0
            assert stats.num_waiting + stats.num_running == 1  # as of the step's start
            release.set()
            await collect(queue)
            # Between steps the counts are exact: the finished request freed its blocks.
            stats = await loop.stats()
            assert (stats.num_running, stats.num_free_blocks) == (0, stats.num_blocks)
        finally:
            release.set()
            loop.stop()

    asyncio.run(run())


@pytest.mark.parametrize("command", ["add", "add_remote"])
def test_a_waiter_cancelled_while_its_command_runs_leaks_nothing(
    model: LoadedModel, command: str
) -> None:
    """A handler cancelled (its client left) while the engine thread runs its add: the add
    completes, and the request it created is aborted right after, its blocks freed."""
    in_add, release = threading.Event(), threading.Event()
    engine_method = {"add": "add_request", "add_remote": "add_remote_request"}[command]

    class SlowAdd(ThreadCheckedEngine):
        def __getattr__(self, name: str) -> Any:
            attr = super().__getattr__(name)
            if name != engine_method:
                return attr

            def slow(*args: Any, **kwargs: Any) -> Any:
                in_add.set()
                release.wait(10)
                return attr(*args, **kwargs)

            return slow

    slow = SlowAdd(make_engine(model))
    loop = EngineLoop(lambda: cast(Engine, slow))
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def run() -> None:
        await loop.start()
        try:
            if command == "add":
                waiter = asyncio.ensure_future(
                    loop.add("r", list(range(3, 40)), long, hold_kv=True)
                )
            else:
                waiter = asyncio.ensure_future(loop.add_remote("r", list(range(3, 40)), long))
            assert await asyncio.to_thread(in_add.wait, 10)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            release.set()
            # Commands run in order: once this one ran, the add and its undo have too.
            await loop.call(lambda engine: None)
            stats = await loop.stats()
            assert stats.num_running + stats.num_waiting + stats.num_remote_waiting == 0
            assert (stats.num_free_blocks, stats.num_held_blocks) == (stats.num_blocks, 0)
            assert await loop.abort("r") == 0  # already gone
        finally:
            release.set()
            loop.stop()

    asyncio.run(run())
