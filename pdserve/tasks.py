"""Background asyncio tasks: the one way pdserve stops them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel every task given (None: skipped), then wait until each has ended, so nothing it
    holds is touched after this returns; their CancelledError is theirs, not the caller's."""
    running = [t for t in tasks if t is not None]
    for task in running:
        task.cancel()
    for task in running:
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def run_to_end(aw: Awaitable[None]) -> None:
    """Await `aw` to its end even when the caller is cancelled meanwhile (a handler whose
    client hung up is cancelled while it cleans up); the cancel is re-raised once it ended.
    Unlike a bare `asyncio.shield`, the caller ends only after `aw` did, so whatever counts the
    caller as running (a drain's admitted calls) sees the cleanup done."""
    task = asyncio.ensure_future(aw)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    task.result()
