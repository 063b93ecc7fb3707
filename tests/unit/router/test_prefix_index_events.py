"""The prefix index fed by KV events: order, epochs, resync, inference switched off; sessions
found from the index on a router that never saw them; the feed against a scripted worker."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from router_harness import run
from test_affinity_policy import HISTORY, NEXT, policy_with_history, query, urls, view

from pdserve.engine.block_manager import prefix_block_hashes
from pdserve.protocol.worker_observe import KVEventBatch, KVEventBatchKind
from pdserve.router.placement.affinity import AffinityPolicy
from pdserve.router.placement.prefix_index import FeedPosition, PrefixIndex
from pdserve.router.workers.client import ClientTimeouts, WorkerClient
from pdserve.router.workers.kv_feed import KVEventFeed

W = "http://w0"


def batch(kind: KVEventBatchKind, seq: int, hashes: tuple[int, ...] = (), epoch: str = "e1"):  # type: ignore[no-untyped-def]
    return KVEventBatch(epoch=epoch, seq=seq, kind=kind, block_hashes=list(hashes))


def test_events_apply_in_order_only() -> None:
    index = PrefixIndex()
    assert not index.apply(W, batch("stored", 1, (5,)))  # nothing before a snapshot
    assert index.apply(W, batch("snapshot", 4, (1, 2, 3)))
    assert index.position(W) == FeedPosition("e1", 4)
    assert index.apply(W, batch("stored", 5, (9,)))
    assert index.apply(W, batch("evicted", 6, (1, 2)))
    assert index.apply(W, batch("heartbeat", 6))
    assert index.lru_order(W) == [3, 9]
    # A skipped number, a stale heartbeat or another epoch changes nothing.
    assert not index.apply(W, batch("stored", 8, (7,)))
    assert not index.apply(W, batch("heartbeat", 7))
    assert not index.apply(W, batch("stored", 7, (7,), epoch="e2"))
    assert index.lru_order(W) == [3, 9] and index.position(W) == FeedPosition("e1", 6)
    assert index.apply(W, batch("cleared", 7))
    assert index.num_blocks(W) == 0
    # The worker restarted: a snapshot of the new epoch replaces everything.
    assert index.apply(W, batch("snapshot", 0, (4,), epoch="e2"))
    assert index.view(W).epoch == "e2" and index.lru_order(W) == [4]


def test_a_fed_worker_ignores_routing_inference_and_restarts_by_epoch_only() -> None:
    index = PrefixIndex()
    index.insert(W, [1, 2], capacity=10)
    assert index.match(W, [1, 2]) == 2 and not index.is_fed(W)
    index.apply(W, batch("snapshot", 1, (5,)))
    index.insert(W, [1, 2], capacity=10)
    assert (index.match(W, [1, 2]), index.match(W, [5])) == (0, 1)
    index.observe(W, "w0:1")
    index.observe(W, "w0:2")  # a new pid alone does not empty a fed worker
    assert index.match(W, [5]) == 1
    index.retain([])
    assert index.position(W) is None and index.num_blocks(W) == 0


def test_views_of_equal_sets_have_equal_digests() -> None:
    a, b = PrefixIndex(), PrefixIndex()
    a.apply(W, batch("snapshot", 3, (1, 2, 3)))
    b.apply(W, batch("snapshot", 2, (3, 1)))
    b.apply(W, batch("stored", 3, (2,)))
    assert a.view(W).digest == b.view(W).digest and a.view(W).num_blocks == 3
    b.apply(W, batch("evicted", 4, (2,)))
    assert a.view(W).digest != b.view(W).digest


def test_a_router_that_never_saw_the_session_finds_its_worker_from_the_events() -> None:
    pool = [view(0), view(1), view(2)]
    holder_hashes = prefix_block_hashes(HISTORY[:64], 16)
    other = AffinityPolicy()
    for i, v in enumerate(pool):
        held = holder_hashes if v.url == "http://w2" else []
        other.index.apply(v.url, batch("snapshot", 0, tuple(held), epoch=f"e{i}"))
    # w0 is the least loaded: without the index the session would start there.
    busy = [view(0), view(1, running=1), view(2, running=3)]
    assert urls(other.rank_decode(busy, query(NEXT, "chat-1")))[0] == "http://w2"
    # The events say w2 evicted the history: the session no longer pulls.
    other.index.apply("http://w2", batch("evicted", 1, (holder_hashes[0],), epoch="e2"))
    assert urls(other.rank_decode(busy, query(NEXT, "chat-1")))[0] == "http://w0"
    # On the router that served it, the recorded holder still breaks a tie of equal prefixes.
    mine = policy_with_history(pool, "http://w1", session="chat-1")
    mine.record(pool, "http://w2", None, HISTORY[:48], HISTORY[48:])
    assert urls(mine.rank_decode(pool, query(NEXT, "chat-1")))[0] == "http://w1"


class ScriptedWorker:
    """Serves /kv_events from a script: one list of lines per connection, then stays open."""

    def __init__(self, scripts: list[list[KVEventBatch]]) -> None:
        self.scripts = scripts
        self.requests: list[dict[str, object]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(json.loads(await request.read()))
        response = web.StreamResponse()
        await response.prepare(request)
        lines = self.scripts.pop(0) if self.scripts else []
        for line in lines:
            await response.write(line.model_dump_json().encode() + b"\n")
        await asyncio.sleep(30)
        return response


def test_the_feed_resumes_by_number_and_resyncs_after_a_gap() -> None:
    async def scenario() -> None:
        worker = ScriptedWorker(
            [
                [batch("snapshot", 2, (1, 2)), batch("stored", 3, (3,))],  # then silence
                [batch("stored", 4, (4,)), batch("stored", 6, (6,))],  # 5 is missing
                [batch("snapshot", 6, (4, 6))],
            ]
        )
        app = web.Application()
        app.router.add_post("/kv_events", worker.handle)
        server = TestServer(app, host="127.0.0.1", port=0)
        await server.start_server()
        url = str(server.make_url("")).rstrip("/")
        index = PrefixIndex()
        async with aiohttp.ClientSession() as session:
            feed = KVEventFeed(
                lambda: [url], WorkerClient(session, ClientTimeouts()), index,
                silence_s=0.3, min_retry_s=0.01,
            )  # fmt: skip
            await feed.start()
            try:
                async with asyncio.timeout(10):
                    while len(worker.requests) < 3 or index.position(url) != FeedPosition("e1", 6):
                        await asyncio.sleep(0.02)
            finally:
                await feed.stop()
        await server.close()
        assert worker.requests == [
            {"after_seq": None, "epoch": None},
            {"after_seq": 3, "epoch": "e1"},  # silent stream dropped: resumed after event 3
            {"after_seq": None, "epoch": None},  # event 5 missing: a snapshot
        ]
        assert sorted(index.lru_order(url)) == [4, 6] and feed.num_resyncs == 1

    run(scenario)
