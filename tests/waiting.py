"""Waiting on what a test asserts, not on the clock: a sleep followed by an assert fails on a
machine slower than the one it was tuned on, and passes late on a fast one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(predicate: Callable[[], object], timeout_s: float = 10.0, what: str = "") -> None:
    """Return as soon as `predicate()` is true; AssertionError after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {what or predicate}")
        await asyncio.sleep(0.005)


def until_sync(predicate: Callable[[], object], timeout_s: float = 10.0, what: str = "") -> None:
    """`until` for tests without an event loop."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s} s: {what or predicate}")
        time.sleep(0.01)
