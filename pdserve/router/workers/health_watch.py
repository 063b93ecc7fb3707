"""Health deadlines: a worker that stops answering its health polls is drained, not waited for.

A worker that is paused (SIGSTOP), hung or cut off by a partition keeps its connections open
and answers nothing: each open token stream would wait out its read timeout (120 s of
silence) and each control call its own (10 s) before the flows fail over. The pool already
stops choosing a worker whose last poll failed; `HealthDeadline` adds the drain: once a
worker has been unhealthy for `deadline_s` without a successful poll in between, its open
streams and calls are cut once (`WorkerClient.abandon`), so they fail as any broken stream
does and the flows' recovery moves them (a decode stream migrates and resumes after the
tokens the client has; a prefill is redone elsewhere). A worker that answers again starts a
new episode. The decision is pure (`due`); `HealthWatch` runs it against the pool.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from pdserve.router.placement.policy import WorkerView
from pdserve.router.workers.client import WorkerClient
from pdserve.router.workers.pool import WorkerPool
from pdserve.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class HealthDeadline:
    """Which workers have been unhealthy for `deadline_s` and are not yet drained. Pure."""

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self._unhealthy_since: dict[str, float] = {}
        self._drained: set[str] = set()

    def due(self, views: Sequence[WorkerView], now: float) -> list[str]:
        """The workers to drain now (each once per episode of unhealthiness)."""
        found: list[str] = []
        urls = {v.url for v in views}
        for url in set(self._unhealthy_since) - urls:
            del self._unhealthy_since[url]
            self._drained.discard(url)
        for v in views:
            if v.healthy:
                self._unhealthy_since.pop(v.url, None)
                self._drained.discard(v.url)
                continue
            since = self._unhealthy_since.setdefault(v.url, now)
            if now - since >= self.deadline_s and v.url not in self._drained:
                self._drained.add(v.url)
                found.append(v.url)
        return found


class HealthWatch:
    """Checks the pool every `interval_s` and drains the workers `HealthDeadline` names."""

    def __init__(
        self, pool: WorkerPool, client: WorkerClient, deadline_s: float, interval_s: float = 0.25
    ) -> None:
        self._pool = pool
        self._client = client
        self._deadline = HealthDeadline(deadline_s)
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        # Workers drained so far (for tests and logs).
        self.num_drained = 0

    async def start(self) -> None:
        """Begin watching."""
        self._task = asyncio.create_task(self._run(), name="health-watch")

    async def stop(self) -> None:
        """Stop watching."""
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._interval_s)
            for url in self._deadline.due(self._pool.snapshot(), loop.time()):
                num_cut = self._client.abandon(url)
                self.num_drained += 1
                log.warning(
                    "worker %s: no health answer for %.1f s; drained (%d open calls cut)",
                    url,
                    self._deadline.deadline_s,
                    num_cut,
                )
