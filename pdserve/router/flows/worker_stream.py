"""A worker's token stream as the disaggregated flow consumes it: one loop for /decode and
/generate alike.

Events pass through up to and including the one that says `finished`; an error event raises
its typed error (retryable unless the worker's error is final, such as a passed deadline),
and a stream that ends before `finished` raises `WorkerUnreachable`: the worker died or the
connection broke. Pure over an async iterator: no I/O of its own.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from pdserve.errors import WorkerCallError, WorkerUnreachable
from pdserve.protocol.worker_api import ErrorBody, TokenEvent

# Worker errors no other worker would avoid: the request fails with them.
FINAL_ERRORS = frozenset({"DeadlineExceeded"})


def stream_error(url: str, event: TokenEvent) -> WorkerCallError:
    """The typed error an error event stands for."""
    detail = event.error or "stream failed"
    kind = event.error_type or "StreamError"
    return WorkerCallError(
        url, 500, ErrorBody(error=detail, type=kind, retryable=kind not in FINAL_ERRORS)
    )


async def until_finished(
    url: str, events: AsyncIterator[TokenEvent], what: str
) -> AsyncGenerator[TokenEvent, None]:
    """`events` through the finished one; raises for an error event or an early end."""
    async for event in events:
        if event.error is not None or event.finish_reason == "error":
            raise stream_error(url, event)
        yield event
        if event.finished:
            return
    raise WorkerUnreachable(url, f"{what} stream ended before finished")
