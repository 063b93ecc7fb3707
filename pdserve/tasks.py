"""Background asyncio tasks: the one way pdserve stops them."""

from __future__ import annotations

import asyncio
import contextlib
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
