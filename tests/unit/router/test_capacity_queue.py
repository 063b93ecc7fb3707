"""The capacity queue: FIFO, bounded, woken by notifications (never by a timer)."""

from __future__ import annotations

import asyncio

import pytest
from waiting import until

from pdserve.errors import NoCapacity
from pdserve.router.flows.capacity_queue import CapacityQueue


def test_waiters_are_served_in_arrival_order_and_only_the_head_is_woken() -> None:
    async def body() -> list[str]:
        queue = CapacityQueue(max_waiting=5)
        order: list[str] = []
        loop = asyncio.get_running_loop()

        async def waiter(name: str) -> None:
            async with queue.join("full") as w:
                await w.next_chance(loop.time() + 5)
                order.append(name)
            queue.notify()  # it found room: the next may too

        tasks = [asyncio.create_task(waiter(n)) for n in "abc"]
        await until(lambda: queue.num_waiting == 3)
        assert order == []
        queue.notify()  # one release: the head goes, then hands on
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(body()) == ["a", "b", "c"]


def test_a_waiter_that_gets_no_room_keeps_its_place_and_a_missed_wakeup_is_kept() -> None:
    async def body() -> None:
        queue = CapacityQueue(max_waiting=5)
        loop = asyncio.get_running_loop()
        async with queue.join("full") as a, queue.join("full") as b:
            queue.notify()
            await a.next_chance(loop.time() + 1)  # woken, tries, fails: still the head
            assert queue.is_head(a) and not queue.is_head(b)
            queue.notify()  # arrives while `a` is busy: not lost
            await a.next_chance(loop.time() + 1)
            with pytest.raises(TimeoutError):
                await b.next_chance(loop.time() + 0.05)  # never woken while not the head

    asyncio.run(body())


def test_a_full_queue_refuses_at_once_and_a_deadline_ends_a_wait() -> None:
    async def body() -> None:
        queue = CapacityQueue(max_waiting=1)
        loop = asyncio.get_running_loop()
        async with queue.join("full") as w:
            with pytest.raises(NoCapacity, match="1 requests already wait"):
                async with queue.join("full"):
                    pass
            with pytest.raises(TimeoutError):
                await w.next_chance(loop.time() + 0.02)
        assert queue.num_waiting == 0

    asyncio.run(body())


def test_a_wakeup_a_leaving_waiter_never_used_goes_to_the_next_in_line() -> None:
    """The head's deadline (or a cancel) lands just as it is woken: the wake-up must not leave
    with it, or the next waiter sleeps until its own deadline though capacity is back."""

    async def body() -> None:
        queue = CapacityQueue(max_waiting=5)
        loop = asyncio.get_running_loop()
        head = queue.join("full")
        await head.__aenter__()
        async with queue.join("full") as b:
            queue.notify()  # for the head, which leaves without having waited on it
            await head.__aexit__(None, None, None)
            await b.next_chance(loop.time() + 1)  # handed on: no TimeoutError
            with pytest.raises(TimeoutError):
                await b.next_chance(loop.time() + 0.05)  # and only once

    asyncio.run(body())


def test_a_waiter_cut_short_while_trying_passes_its_chance_on_when_it_leaves() -> None:
    async def body() -> None:
        queue = CapacityQueue(max_waiting=5)
        loop = asyncio.get_running_loop()
        head = queue.join("full")
        a = await head.__aenter__()
        async with queue.join("full") as b:
            queue.notify()
            await a.next_chance(loop.time() + 1)  # woken: now trying
            a.pass_on()  # its try was cancelled
            assert queue.is_head(a)  # still in line until it leaves
            with pytest.raises(TimeoutError):
                await b.next_chance(loop.time() + 0.05)
            await head.__aexit__(None, None, None)
            await b.next_chance(loop.time() + 1)  # b got the chance

    asyncio.run(body())
