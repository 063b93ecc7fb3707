"""`pdserve.tasks`: stopping background tasks, and cleanup that a cancel cannot cut short."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.tasks import cancel_and_wait, run_to_end


def test_a_cleanup_runs_to_its_end_when_its_caller_is_cancelled_mid_way() -> None:
    """A handler cancelled while it cleans up (aiohttp cancels it when its client hangs up)
    still finishes every step; the cancel reaches the caller once the cleanup ended."""
    steps: list[str] = []

    async def main() -> None:
        release = asyncio.Event()

        async def cleanup() -> None:
            steps.append("cancel the reservation")
            await release.wait()
            steps.append("abort the engine request")

        caller = asyncio.create_task(run_to_end(cleanup()))
        while not steps:
            await asyncio.sleep(0)
        caller.cancel()
        caller.cancel()  # twice: each cancel is absorbed while the cleanup runs
        for _ in range(5):
            await asyncio.sleep(0)
        assert not caller.done() and steps == ["cancel the reservation"]
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert steps == ["cancel the reservation", "abort the engine request"]

    asyncio.run(main())


def test_a_cleanup_that_fails_raises_its_error_and_one_that_ends_returns() -> None:
    async def fails() -> None:
        raise RuntimeError("engine gone")

    async def ends() -> None:
        await asyncio.sleep(0)

    async def main() -> None:
        with pytest.raises(RuntimeError, match="engine gone"):
            await run_to_end(fails())
        await run_to_end(ends())

    asyncio.run(main())


def test_cancel_and_wait_skips_none_and_waits_for_each_end() -> None:
    ended: list[str] = []

    async def main() -> None:
        async def forever(name: str) -> None:
            try:
                await asyncio.Event().wait()
            finally:
                ended.append(name)

        a, b = asyncio.create_task(forever("a")), asyncio.create_task(forever("b"))
        await asyncio.sleep(0)
        await cancel_and_wait(a, None, b)
        assert (a.cancelled(), b.cancelled(), ended) == (True, True, ["a", "b"])

    asyncio.run(main())
