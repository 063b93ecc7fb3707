"""The router's workers: who they are (membership), their last health, and in-flight counts.

Membership decides who is in the pool; health decides who may be chosen. The pool is built
from a static list of URLs (the constructor's `urls`) and/or fed by a `Membership` (a static
list or etcd), whose listener hands it the whole member set after every change: new URLs join
(numbered after every worker seen so far, so `WorkerView.index` stays the configured/joined
order), URLs no longer listed leave at once and are never chosen again. A request already on a
worker that left keeps its call; if the worker is gone the call fails and the flow's own
failover (re-prefill, migration) takes over, exactly as for any dead worker.

Life cycle: `start()` starts the membership, polls every worker once (so the first request
already has a view) and then keeps a background task polling each worker on its own schedule:
a healthy one every `poll_interval_s`, one that is down every `RECHECK_INTERVAL_S` with a
short timeout, so a worker that heals (a partition lifted, a pause ended, a restart) is chosen
again on its first good answer, within about half a second, and a poll hanging on one worker
never delays another's. A worker that joins later is polled at once. `stop()` stops both. A
worker whose poll fails is marked unhealthy (and so never chosen) until a later poll succeeds;
its return wakes the capacity queue, as growing free blocks do. The router reports failures it
sees on calls with `mark_failed`, which takes a worker out at once instead of waiting for the
next poll.

Each health poll is also a clock echo: the worker's answer carries its monotonic clock, and
the pool keeps a `ClockSync` per worker (`clock_offset_ns`) so the router can place worker
timeline events on its own clock.

A worker that runs another model than the router's (`model_check` says what differs) is
never healthy, whatever it answers: its problem is kept for the router's /health. A poll that
sees a decode worker's free blocks grow tells `on_capacity` (the capacity queue's wake-up).

The pool knows nothing about requests or modes; `snapshot()` hands the policy an immutable view.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from pdserve.errors import RouterError
from pdserve.membership import Member, Membership, diff_members
from pdserve.membership.base import normalize_url
from pdserve.observability.clock_sync import ClockSync
from pdserve.protocol.worker_api import WorkerHealth
from pdserve.router.placement.policy import WorkerView
from pdserve.router.workers.client import WorkerClient
from pdserve.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# How often a worker that is down is asked again, and how long such an ask may take: a heal is
# seen within about their sum (a poll sent into a partition is given up quickly, and the next
# one opens a fresh connection).
RECHECK_INTERVAL_S = 0.25
RECHECK_TIMEOUT_S = 0.5


@dataclass(slots=True)
class _Entry:
    member: Member
    index: int
    health: WorkerHealth | None = None
    healthy: bool = False
    num_inflight: int = 0
    last_error: str | None = None
    clock: ClockSync = field(default_factory=ClockSync)
    # Why the worker is not the router's model (None: it is, or not polled yet).
    model_problem: str | None = None
    # When its last poll began (loop time), and that poll while it runs.
    polled_at: float = float("-inf")
    polling: asyncio.Task[None] | None = None
    # Polls that found a new instance at this URL (the worker restarted at its address).
    num_restarts: int = 0

    @property
    def url(self) -> str:
        return self.member.url


class WorkerPool:
    """The member workers and what the router last learned about each."""

    def __init__(
        self,
        urls: Sequence[str],
        client: WorkerClient,
        poll_interval_s: float = 1.0,
        membership: Membership | None = None,
        model_check: Callable[[WorkerHealth], str | None] | None = None,
        on_capacity: Callable[[], None] | None = None,
    ) -> None:
        self._entries: dict[str, _Entry] = {}
        # Never reused: a worker that leaves and joins again sorts after every earlier one.
        self._next_index = 0
        for url in urls:
            self._add(Member(url=normalize_url(url)))
        self._client = client
        self._poll_interval_s = poll_interval_s
        self._membership = membership
        self._model_check = model_check
        self._on_capacity = on_capacity
        self._task: asyncio.Task[None] | None = None
        self._join_polls: set[asyncio.Task[None]] = set()

    @property
    def urls(self) -> list[str]:
        """Worker base URLs in configured/joined order."""
        return list(self._entries)

    def members(self) -> list[Member]:
        """Every member, in configured/joined order."""
        return [e.member for e in self._entries.values()]

    @property
    def membership_refused(self) -> int:
        """Registrations the membership ignored (unreadable or unsigned)."""
        return 0 if self._membership is None else self._membership.num_refused

    async def start(self) -> None:
        """Start the membership, poll once now, then keep polling in the background."""
        if self._membership is not None:
            await self._membership.start(self.apply_members)
        await self.poll_once()
        self._task = asyncio.create_task(self._poll_forever(), name="worker-pool-poll")

    async def stop(self) -> None:
        """Stop the membership and background polling."""
        if self._membership is not None:
            await self._membership.stop()
        polls = [e.polling for e in self._entries.values() if e.polling is not None]
        tasks = [t for t in (self._task, *self._join_polls, *polls) if t is not None]
        await cancel_and_wait(*tasks)
        self._task = None
        self._join_polls.clear()

    def apply_members(self, members: Sequence[Member]) -> None:
        """Make the pool's workers exactly `members` (the membership's listener)."""
        diff = diff_members(self.members(), members)
        for member in diff.removed:
            entry = self._entries.pop(normalize_url(member.url))
            if entry.health is not None and entry.health.draining:
                # It left on purpose and finishes what it holds: its calls run to their end.
                log.info("pool: %s (%s) left, draining", entry.url, member.worker_id or "static")
                continue
            num_cut = self._client.abandon(entry.url)
            self._client.forget_target(entry.url)
            log.info(
                "pool: %s (%s) left; %d open streams cut",
                entry.url,
                member.worker_id or "static",
                num_cut,
            )
        for member in diff.updated:
            entry = self._entries[normalize_url(member.url)]
            entry.member = member
            # Another process may answer there now: trust nothing until it is polled.
            entry.health, entry.healthy = None, False
            self._poll_soon(entry)
        for member in diff.added:
            entry = self._add(member)
            log.info("pool: %s (%s) joined", entry.url, member.worker_id or "static")
            self._poll_soon(entry)

    def _add(self, member: Member) -> _Entry:
        member = replace(member, url=normalize_url(member.url))
        entry = _Entry(member, self._next_index)
        self._next_index += 1
        self._entries[entry.url] = entry
        return entry

    def _poll_soon(self, entry: _Entry) -> None:
        # Before start() the first poll_once covers it; after, a joiner should not wait a
        # whole poll interval before it can be chosen.
        if self._task is None:
            return
        task = asyncio.create_task(self._poll(entry), name=f"worker-pool-join {entry.url}")
        self._join_polls.add(task)
        task.add_done_callback(self._join_polls.discard)

    async def poll_once(self) -> None:
        """GET /health on every worker concurrently and record the results."""
        await asyncio.gather(*(self._poll(e) for e in list(self._entries.values())))

    async def _poll(self, entry: _Entry) -> None:
        entry.polled_at = asyncio.get_running_loop().time()
        was_healthy = entry.healthy
        try:
            sent_ns = time.monotonic_ns()
            timeout_s = None if was_healthy else RECHECK_TIMEOUT_S
            health = await self._client.health(entry.url, timeout_s)
            received_ns = time.monotonic_ns()
        except RouterError as exc:
            entry.healthy = False
            entry.last_error = str(exc)
            return
        if health.monotonic_ns is not None:
            arrived = health.request_monotonic_ns
            entry.clock.add(
                sent_ns,
                health.monotonic_ns if arrived is None else arrived,
                received_ns,
                remote_sent_ns=health.monotonic_ns,
            )
        if self._model_check is not None:
            entry.model_problem = self._model_check(health)
            if entry.model_problem is not None:
                entry.health, entry.healthy = health, False
                entry.last_error = entry.model_problem
                return
        if health.instance_id and self._client.set_target(
            entry.url, health.worker_id, health.instance_id
        ):
            # Restarted at the same address: nothing the old life held is there any more.
            # Calls still open to it are cut (they fail over), and the capacity it showed is
            # not compared with the new life's.
            num_cut = self._client.abandon(entry.url)
            log.warning(
                "pool: %s restarted (now instance %s); %d open calls cut",
                entry.url,
                health.instance_id,
                num_cut,
            )
            entry.num_restarts += 1
            entry.health, was_healthy = None, False
        before = entry.health.num_free_blocks if entry.health is not None else None
        entry.health = health
        entry.healthy = True
        entry.last_error = None
        if not was_healthy and before is not None:
            log.info("pool: %s answers again", entry.url)
        grew = before is not None and health.num_free_blocks > before
        if self._on_capacity is not None and (grew or not was_healthy):
            self._on_capacity()

    async def _poll_forever(self) -> None:
        loop = asyncio.get_running_loop()
        tick = min(self._poll_interval_s, RECHECK_INTERVAL_S)
        while True:
            now = loop.time()
            for entry in list(self._entries.values()):
                interval = self._poll_interval_s if entry.healthy else RECHECK_INTERVAL_S
                if entry.polling is None and now - entry.polled_at >= interval:
                    entry.polled_at = now  # (again as it starts: a poll_once counts too)
                    entry.polling = asyncio.create_task(
                        self._poll(entry), name=f"worker-pool-poll {entry.url}"
                    )
                    entry.polling.add_done_callback(functools.partial(_done_polling, entry))
            await asyncio.sleep(tick)

    def snapshot(self) -> list[WorkerView]:
        """An immutable view of every member worker for the policy."""
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

    def clock(self, url: str) -> ClockSync | None:
        """The clock estimate of a member worker (it has no sample before its first poll)."""
        entry = self._entries.get(url)
        return None if entry is None else entry.clock

    def model_problems(self) -> list[str]:
        """Workers that run another model than the router's, each with what differs."""
        return [
            f"worker {e.url} runs another model: {e.model_problem}"
            for e in self._entries.values()
            if e.model_problem is not None
        ]

    def digest_of(self, url: str) -> str | None:
        """The fingerprint digest (revision) `url` last reported, None before its first poll."""
        entry = self._entries.get(url)
        return None if entry is None or entry.health is None else entry.health.fingerprint_digest

    def num_restarts(self, url: str) -> int:
        """Times `url` answered as a new instance of its worker (restarts seen)."""
        entry = self._entries.get(url)
        return 0 if entry is None else entry.num_restarts

    def last_error(self, url: str) -> str | None:
        """The last poll or call failure recorded for `url`."""
        entry = self._entries.get(url)
        return None if entry is None else entry.last_error

    @contextlib.contextmanager
    def inflight(self, url: str) -> Iterator[None]:
        """Count a request against `url` for as long as the block runs.

        A worker that left the pool between selection and this call is counted on a detached
        entry: the call proceeds and fails or succeeds on its own.
        """
        entry = self._entries.get(url) or _Entry(Member(url=url), -1)
        entry.num_inflight += 1
        try:
            yield
        finally:
            entry.num_inflight -= 1


def _done_polling(entry: _Entry, task: asyncio.Task[None]) -> None:
    entry.polling = None
