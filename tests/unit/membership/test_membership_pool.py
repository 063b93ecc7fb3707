"""The router's pool fed by membership: joins, leaves, updates, indexes and in-flight counts."""

from __future__ import annotations

import asyncio
from typing import Any

from waiting import until

from pdserve.errors import WorkerUnreachable
from pdserve.membership import Member, StaticMembership
from pdserve.protocol.worker_api import WorkerHealth
from pdserve.router.workers.pool import WorkerPool


class StubClient:
    """Answers /health for the URLs in `up`, with the worker id `ids` gives."""

    def __init__(self, up: dict[str, str]) -> None:
        self.up = up
        self.polled: list[str] = []
        self.abandoned: list[str] = []

    def abandon(self, url: str) -> int:
        self.abandoned.append(url)
        return 0

    def set_target(self, url: str, worker_id: str, instance_id: str) -> bool:
        return False

    def forget_target(self, url: str) -> None:
        pass

    async def health(self, url: str, timeout_s: float | None = None) -> WorkerHealth:
        self.polled.append(url)
        if url not in self.up:
            raise WorkerUnreachable(url, "connection refused")
        return WorkerHealth(
            worker_id=self.up[url], role="both", pid=1, fingerprint={}, fingerprint_digest="d",
            transfer_address=None, max_model_len=256, block_size=16, num_blocks=8,
            num_free_blocks=8, num_pinned_blocks=0, num_running=0, num_waiting=0,
            num_active_leases=0,
        )  # fmt: skip


class ManualMembership:
    """A membership the test changes by hand."""

    def __init__(self, members: list[Member]) -> None:
        self.current = members
        self.listener: Any = None
        self.stopped = False

    async def start(self, listener: Any) -> None:
        self.listener = listener
        listener(self.current)

    def members(self) -> list[Member]:
        return list(self.current)

    async def stop(self) -> None:
        self.stopped = True

    def set(self, members: list[Member]) -> None:
        self.current = members
        self.listener(members)


def m(n: int) -> Member:
    return Member(f"http://w{n}", f"w{n}", "both", "d")


def views(pool: WorkerPool) -> list[tuple[str, int, bool]]:
    return [(v.url, v.index, v.healthy) for v in pool.snapshot()]


def test_static_list_keeps_the_constructor_usable_and_in_order() -> None:
    pool = WorkerPool(["http://a/", "http://b"], StubClient({}))  # type: ignore[arg-type]
    assert pool.urls == ["http://a", "http://b"]
    assert views(pool) == [("http://a", 0, False), ("http://b", 1, False)]


def test_joins_are_numbered_after_everyone_seen_and_polled_at_once() -> None:
    async def scenario() -> None:
        client = StubClient({"http://w1": "w1", "http://w2": "w2", "http://w3": "w3"})
        membership = ManualMembership([m(1), m(2)])
        pool = WorkerPool((), client, 60.0, membership=membership)  # type: ignore[arg-type]
        await pool.start()
        assert views(pool) == [("http://w1", 0, True), ("http://w2", 1, True)]
        membership.set([m(2), m(3)])  # w1 leaves, w3 joins
        assert views(pool) == [("http://w2", 1, True), ("http://w3", 2, False)]
        assert client.abandoned == ["http://w1"]  # its open streams are cut at once
        # The join poll, not the 60 s interval.
        await until(lambda: views(pool) == [("http://w2", 1, True), ("http://w3", 2, True)])
        membership.set([m(2), m(3), m(1)])  # w1 back: a new index, after w3
        await until(lambda: [i for _, i, _ in views(pool)] == [1, 2, 3])
        await pool.stop()
        assert membership.stopped

    asyncio.run(scenario())


def test_an_updated_member_is_not_chosen_until_polled_again() -> None:
    async def scenario() -> None:
        client = StubClient({"http://w1": "w1"})
        membership = ManualMembership([m(1)])
        pool = WorkerPool((), client, 60.0, membership=membership)  # type: ignore[arg-type]
        await pool.start()
        client.up["http://w1"] = "w1-restarted"
        membership.set([Member("http://w1", "w1-restarted", "both", "d")])
        assert views(pool) == [("http://w1", 0, False)]
        await until(lambda: pool.snapshot()[0].healthy, what="w1 polled again")
        (view,) = pool.snapshot()
        assert view.healthy and view.health is not None
        assert view.health.worker_id == "w1-restarted"
        await pool.stop()

    asyncio.run(scenario())


def test_inflight_survives_a_leave_and_counts_nothing_on_the_remaining() -> None:
    async def scenario() -> None:
        membership = ManualMembership([m(1), m(2)])
        client = StubClient({"http://w1": "w1", "http://w2": "w2"})
        pool = WorkerPool((), client, 60.0, membership=membership)  # type: ignore[arg-type]
        await pool.start()
        with pool.inflight("http://w1"):
            membership.set([m(2)])
            assert [v.url for v in pool.snapshot()] == ["http://w2"]
        with pool.inflight("http://w1"):  # chosen just before it left: still callable
            pass
        assert [v.num_inflight for v in pool.snapshot()] == [0]
        pool.mark_failed("http://w1", "gone")  # no effect, no error
        assert pool.last_error("http://w1") is None
        await pool.stop()

    asyncio.run(scenario())


def test_static_membership_delivers_the_list_once() -> None:
    async def scenario() -> None:
        got: list[list[str]] = []
        static = StaticMembership(["http://a/", "http://b"])
        await static.start(lambda ms: got.append([x.url for x in ms]))
        assert got == [["http://a", "http://b"]]
        assert static.members() == [Member("http://a"), Member("http://b")]
        await static.stop()

    asyncio.run(scenario())


def test_a_worker_that_answers_again_is_back_on_its_first_good_poll() -> None:
    """A worker down (a partition, a pause) is asked again every RECHECK_INTERVAL_S, however
    long the healthy poll interval: back within about half a second of its first answer, and
    its return wakes whoever waits for capacity."""

    async def body() -> None:
        client = StubClient({"http://w1": "w1", "http://w2": "w2"})
        woken: list[int] = []
        pool = WorkerPool(["http://w1", "http://w2"], client, 60.0,  # type: ignore[arg-type]
                          on_capacity=lambda: woken.append(1))  # fmt: skip
        await pool.start()
        try:
            del client.up["http://w1"]
            pool.mark_failed("http://w1", "the stream broke")
            await until(lambda: client.polled.count("http://w1") >= 3, 5, "rechecks of w1")
            assert not dict((u, h) for u, _, h in views(pool))["http://w1"]
            polls_of_w2 = client.polled.count("http://w2")
            client.up["http://w1"] = "w1"
            loop = asyncio.get_running_loop()
            healed = loop.time()
            await until(lambda: dict((u, h) for u, _, h in views(pool))["http://w1"], 5, "w1 back")
            assert loop.time() - healed < 1.0
            assert woken, "its return did not wake the capacity queue"
            # The healthy worker kept its own, slow schedule meanwhile.
            assert client.polled.count("http://w2") == polls_of_w2
        finally:
            await pool.stop()

    asyncio.run(body())
