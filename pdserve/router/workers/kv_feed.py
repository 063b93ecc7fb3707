"""Follows every pool member's KV events (POST /kv_events) into the router's prefix index.

One task per member URL, started and stopped as the pool's members change (checked every
`sync_interval_s`). A task streams the worker's events through `WorkerClient.kv_events`,
resuming after the last event it applied (same epoch and number: the worker replays what was
missed) and otherwise asking for a snapshot. `PrefixIndex.apply` decides whether a line
follows; one that does not ends the stream, and the next one starts from a snapshot. A stream
silent for `silence_s` (the worker sends a heartbeat every second) is dropped and reopened: a
paused or partitioned worker cannot hold the feed. A worker that does not serve the endpoint
(an older worker, a test double) is asked again every `max_retry_s`; its index entries stay
inferred from routing meanwhile.

It knows the pool's URLs, the client and the index; nothing about requests or placement.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from pdserve.errors import RouterError
from pdserve.protocol.worker_observe import KVEventsRequest
from pdserve.router.placement.prefix_index import PrefixIndex
from pdserve.router.workers.client import WorkerClient
from pdserve.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class KVEventFeed:
    """Keeps `index` current with the KV events of the workers `urls()` names."""

    def __init__(
        self,
        urls: Callable[[], Sequence[str]],
        client: WorkerClient,
        index: PrefixIndex,
        sync_interval_s: float = 0.5,
        silence_s: float = 5.0,
        min_retry_s: float = 0.5,
        max_retry_s: float = 5.0,
    ) -> None:
        self._urls = urls
        self._client = client
        self._index = index
        self._sync_interval_s = sync_interval_s
        self._silence_s = silence_s
        self._min_retry_s = min_retry_s
        self._max_retry_s = max_retry_s
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._sync_task: asyncio.Task[None] | None = None
        # Streams ended because a line did not follow (the next one starts from a snapshot).
        self.num_resyncs = 0
        # Streams (re)opened, snapshots included.
        self.num_connects = 0

    async def start(self) -> None:
        """Follow the current members now and keep following as they change."""
        self.sync()
        self._sync_task = asyncio.create_task(self._sync_forever(), name="kv-feed-sync")

    async def stop(self) -> None:
        """Stop every stream."""
        tasks = [t for t in (self._sync_task, *self._tasks.values()) if t is not None]
        await cancel_and_wait(*tasks)
        self._tasks.clear()
        self._sync_task = None

    def sync(self) -> None:
        """Start following new members and stop following those that left."""
        current = set(self._urls())
        for url in current - set(self._tasks):
            self._tasks[url] = asyncio.create_task(self._follow(url), name=f"kv-feed {url}")
        for url in set(self._tasks) - current:
            self._tasks.pop(url).cancel()
            self._index.remove(url)

    async def _sync_forever(self) -> None:
        while True:
            await asyncio.sleep(self._sync_interval_s)
            self.sync()

    async def _follow(self, url: str) -> None:
        delay = self._min_retry_s
        snapshot_next = False
        while True:
            at = None if snapshot_next else self._index.position(url)
            request = (
                KVEventsRequest()
                if at is None
                else KVEventsRequest(after_seq=at.seq, epoch=at.epoch)
            )
            snapshot_next = False
            try:
                self.num_connects += 1
                async with contextlib.aclosing(self._client.kv_events(url, request)) as stream:
                    while True:
                        async with asyncio.timeout(self._silence_s):
                            batch = await anext(stream, None)
                        if batch is None:
                            break
                        if not self._index.apply(url, batch):
                            self.num_resyncs += 1
                            snapshot_next = True
                            log.info("kv feed %s: event %d does not follow; resync", url, batch.seq)
                            break
                        delay = self._min_retry_s
            except (RouterError, TimeoutError) as exc:
                log.debug("kv feed %s: %s; again in %.1f s", url, exc, delay)
            if not snapshot_next:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._max_retry_s)
