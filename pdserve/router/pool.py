"""The router's workers: a static list of URLs, their last health, and in-flight counts.

Life cycle: `start()` polls every worker once (so the first request already has a view) and
then keeps a background task polling every `poll_interval_s`; `stop()` cancels it. A worker
whose poll fails is marked unhealthy (and so never chosen) until a later poll succeeds. The
router reports failures it sees on calls with `mark_failed`, which takes a worker out at once
instead of waiting for the next poll.

The pool knows nothing about requests or modes; `snapshot()` hands the policy an immutable view.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pdserve.errors import RouterError
from pdserve.router.policy import WorkerView
from pdserve.router.worker_client import WorkerClient
from pdserve.worker.protocol import WorkerHealth


@dataclass(slots=True)
class _Entry:
    url: str
    index: int
    health: WorkerHealth | None = None
    healthy: bool = False
    num_inflight: int = 0
    last_error: str | None = None


class WorkerPool:
    """The configured workers and what the router last learned about each."""

    def __init__(
        self, urls: Sequence[str], client: WorkerClient, poll_interval_s: float = 1.0
    ) -> None:
        self._entries = {url.rstrip("/"): _Entry(url.rstrip("/"), i) for i, url in enumerate(urls)}
        self._client = client
        self._poll_interval_s = poll_interval_s
        self._task: asyncio.Task[None] | None = None

    @property
    def urls(self) -> list[str]:
        """Worker base URLs in configured order."""
        return list(self._entries)

    async def start(self) -> None:
        """Poll once now, then keep polling in the background."""
        await self.poll_once()
        self._task = asyncio.create_task(self._poll_forever(), name="worker-pool-poll")

    async def stop(self) -> None:
        """Stop background polling."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def poll_once(self) -> None:
        """GET /health on every worker concurrently and record the results."""
        await asyncio.gather(*(self._poll(e) for e in self._entries.values()))

    async def _poll(self, entry: _Entry) -> None:
        try:
            entry.health = await self._client.health(entry.url)
        except RouterError as exc:
            entry.healthy = False
            entry.last_error = str(exc)
            return
        entry.healthy = True
        entry.last_error = None

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            await self.poll_once()

    def snapshot(self) -> list[WorkerView]:
        """An immutable view of every worker for the policy."""
        return [
            WorkerView(e.url, e.index, e.health, e.healthy, e.num_inflight)
            for e in self._entries.values()
        ]

    def mark_failed(self, url: str, reason: str) -> None:
        """Take a worker out of selection until its next successful poll."""
        entry = self._entries.get(url)
        if entry is not None:
            entry.healthy = False
            entry.last_error = reason

    def last_error(self, url: str) -> str | None:
        """The last poll or call failure recorded for `url`."""
        entry = self._entries.get(url)
        return None if entry is None else entry.last_error

    @contextlib.contextmanager
    def inflight(self, url: str) -> Iterator[None]:
        """Count a request against `url` for as long as the block runs."""
        entry = self._entries[url]
        entry.num_inflight += 1
        try:
            yield
        finally:
            entry.num_inflight -= 1
