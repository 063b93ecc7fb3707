"""The decode side's replica, without sockets: blocks go to the holder as the policy says, in
chained puts whose versions count tokens; a failing holder stops the replica (counted) and
never the request; the request's end releases its copy."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch
from checkpoint_fakes import FakeSender
from waiting import until

from pdserve.engine.block_manager import prefix_block_hashes
from pdserve.engine.canary import ValueDigest
from pdserve.errors import ConfigError, LinkUnsupported, PeerCallError, RequestNotFound
from pdserve.protocol.checkpoint_api import CheckpointOwner, CheckpointPut
from pdserve.protocol.worker_api import CheckpointPlan, KVEndpoint, Reservation
from pdserve.worker.checkpoint.stream import CheckpointStreams, on_tokens
from pdserve.worker.config import WorkerConfig
from pdserve.worker.engine_loop import EngineInfo

BS = 4
INFO = EngineInfo({}, "fp-a", 1, BS, 8, "float32", 64, 1024)
RESERVATION = Reservation(
    request_id="r@4",
    transfer_id="11" * 16,
    capability_token="22" * 16,
    endpoints=[KVEndpoint(transport="tcp", address="127.0.0.1:9")],
    lease_epoch=0,
    num_cached_tokens=0,
    lease_ttl_s=30.0,
)


class FakeEngine:
    def __init__(self) -> None:
        self.gone = False
        # False: the request waits for its first step, so it holds no blocks yet.
        self.scheduled = True

    def block_ids(self, request_id: str) -> list[int]:
        return list(range(8))

    def position_logits(self, block_ids: list[int], token_id: int, position: int) -> torch.Tensor:
        # Logits that name the position and token, so the digest binds both.
        logits = torch.zeros(16)
        logits[token_id % 16] = float(position)
        return logits

    def copy_blocks(self, request_id: str, start: int, end: int) -> list[bytes]:
        if self.gone or not self.scheduled:
            raise RequestNotFound(f"request {request_id}: blocks {start}..{end} not held")
        return [bytes([i]) * 8 for i in range(start, end)]


class FakeLoop:
    def __init__(self) -> None:
        self.engine = FakeEngine()

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        return fn(self.engine)


class FakePeers:
    def __init__(self) -> None:
        self.posts: list[tuple[str, Any]] = []
        self.fail = False
        # A holder that answers releases this late (a paused one never does).
        self.release_delay_s = 0.0

    async def post(self, url: str, path: str, body: Any, model: type[Any], **_: Any) -> Any:
        self.posts.append((path, body))
        if path == "/checkpoint/release":
            await asyncio.sleep(self.release_delay_s)
        if self.fail:
            raise PeerCallError(url, 0, "", "unreachable")
        return RESERVATION if path == "/checkpoint/put" else None


def _streams() -> tuple[CheckpointStreams, FakeLoop, FakePeers, FakeSender]:
    loop, peers, sender = FakeLoop(), FakePeers(), FakeSender(8)
    streams = CheckpointStreams(loop, INFO, peers, sender, ("tcp",), canary=True)  # type: ignore[arg-type]
    return streams, loop, peers, sender


def _puts(peers: FakePeers) -> list[CheckpointPut]:
    return [body for path, body in peers.posts if path == "/checkpoint/put"]


def test_every_block_goes_once_in_a_chain_and_the_end_releases() -> None:
    async def scenario() -> None:
        streams, _, peers, sender = _streams()
        plan = CheckpointPlan(holder_url="http://h", policy="every-1", lease_ttl_s=30.0)
        prompt = list(range(10, 19))  # 9 tokens: two full blocks
        replica = streams.open("r", plan, [*prompt, 50], len(prompt))
        assert replica is not None
        seen = on_tokens(replica, None)
        await asyncio.sleep(0)
        for token in range(51, 58):  # 17 tokens in all: four blocks hold computed KV
            seen(_delta([token]))
            await asyncio.sleep(0)
        await until(lambda: replica.num_sent_blocks == 4)
        tokens = [*prompt, *range(50, 58)]
        puts = _puts(peers)
        assert (puts[0].first_version, len(puts[0].block_tokens)) == (4, 2)  # the prompt
        # Contiguous, each block once: version v starts where the last put ended.
        ends = [p.first_version - BS + BS * len(p.block_tokens) for p in puts]
        assert [p.first_version - BS for p in puts] == [0, *ends[:-1]] and ends[-1] == 16
        assert replica.num_sent_blocks == 4
        hashes = prefix_block_hashes(tokens[:16], BS)
        for put in puts[1:]:
            assert put.parent_hash == hashes[put.first_version // BS - 2]  # the chain
        assert sender.sent[0][0] == "r@4" and sender.sent[0][1] == tokens[:8]
        # Each put carries the value digest of its last position (the reader's canary).
        first = ValueDigest.decode(sender.digests[0])
        assert first.position == 7 and first.top_ids[0] == tokens[7] % 16
        assert streams.counters.num_blocks_put == 4 and streams.counters.num_bytes_put == 32
        assert streams.counters.bytes_by_transport == {"tcp": 32}  # the holder offers TCP
        await replica.close()
        await streams.aclose()  # the release goes in the background
        assert peers.posts[-1] == ("/checkpoint/release", CheckpointOwner(owner="r"))

    asyncio.run(scenario())


def test_a_request_not_yet_run_is_replicated_from_its_first_tokens() -> None:
    """/generate (a cached prompt, a resume) opens the replica before the engine has run the
    request, which holds no blocks until then: the puts start with the first tokens, rather
    than the first put finding nothing and the replica stopping for the whole request."""

    async def scenario() -> None:
        streams, loop, peers, _ = _streams()
        loop.engine.scheduled = False
        plan = CheckpointPlan(holder_url="http://h", policy="every-1", lease_ttl_s=30.0)
        prompt = list(range(10, 19))  # two full blocks, found in the prefix cache
        replica = streams.open("r", plan, prompt, len(prompt), computed=False)
        assert replica is not None
        for _ in range(5):
            await asyncio.sleep(0)
        assert _puts(peers) == [] and not replica.stopped
        loop.engine.scheduled = True  # the step ran: the whole prompt has KV, a token came
        on_tokens(replica, None)(_delta([50]))
        await until(lambda: replica.num_sent_blocks == 2)
        assert not replica.stopped and streams.counters.num_blocks_put == 2
        await replica.close()
        await streams.aclose()

    asyncio.run(scenario())


def test_the_end_of_a_request_never_waits_for_a_paused_holder() -> None:
    async def scenario() -> None:
        streams, _, peers, _ = _streams()
        peers.release_delay_s = 60.0  # the holder is stopped: the release hangs
        plan = CheckpointPlan(holder_url="http://h", policy="prompt", lease_ttl_s=30.0)
        replica = streams.open("r", plan, list(range(9)), 8)
        assert replica is not None
        await until(lambda: replica.num_sent_blocks == 2)  # the prompt's put is done
        started = asyncio.get_running_loop().time()
        await replica.close()
        assert asyncio.get_running_loop().time() - started < 1.0
        # The release is on its way, in the background.
        await until(lambda: ("/checkpoint/release", CheckpointOwner(owner="r")) in peers.posts)
        await streams.aclose()  # gives up on it after a moment, leaving no task behind

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_failing_holder_stops_the_replica_counted_and_an_ended_request_is_not_a_failure() -> None:
    async def scenario() -> None:
        streams, loop, peers, _ = _streams()
        plan = CheckpointPlan(holder_url="http://h", policy="prompt", lease_ttl_s=30.0)
        peers.fail = True
        replica = streams.open("r", plan, list(range(9)), 8)
        assert replica is not None
        await until(lambda: replica.stopped and streams.counters.failures == {"PeerCallError": 1})
        peers.fail = False
        loop.engine.gone = True
        ended = streams.open("r2", plan, list(range(9)), 8)
        assert ended is not None
        await until(lambda: ended.stopped)
        assert sum(streams.counters.failures.values()) == 1
        off = CheckpointPlan(holder_url="http://h", policy="off")
        assert streams.open("r3", off, [1, 2], 2) is None
        await replica.close()
        await ended.close()

    asyncio.run(scenario())


def _delta(tokens: list[int]) -> Any:
    from pdserve.engine.outputs import RequestDelta

    return RequestDelta("r", tuple(tokens), False, None)


def test_small_puts_go_over_tcp_and_large_ones_over_the_workers_best_transport() -> None:
    loop, peers, sender = FakeLoop(), FakePeers(), FakeSender(8)
    local = ("nixl", "shm", "tcp")

    def streams(small: int, have: tuple[str, ...] = local) -> CheckpointStreams:
        return CheckpointStreams(loop, INFO, peers, sender, have, small_put_bytes=small)  # type: ignore[arg-type]

    s = streams(2 << 20)
    assert s.transports_for(64 << 10) == ("tcp",)
    assert s.transports_for(2 << 20) == ("tcp",)
    assert s.transports_for((2 << 20) + 1) == local
    # Off, or a worker without TCP among its transports (an explicit --kv-transport): as is.
    assert streams(0).transports_for(1) == local
    assert streams(2 << 20, ("shm",)).transports_for(1) == ("shm",)


@pytest.mark.parametrize("bad", [-1, (1 << 20) + 1, 1.5])
def test_a_bad_small_put_size_is_refused_naming_the_flag(bad: object) -> None:
    with pytest.raises(ConfigError, match="checkpoint-small-put-kib"):
        WorkerConfig(checkpoint_small_put_kib=bad)  # type: ignore[arg-type]


class FakeLinks:
    """A `CheckpointLinks` that records puts, or stands for a holder that serves no links."""

    def __init__(self, unsupported: bool) -> None:
        self.unsupported = unsupported
        self.puts: list[Any] = []

    async def put(
        self, address: Any, put: Any, blocks: list[memoryview], peer_instance: bytes = b""
    ) -> int:
        self.puts.append(put)
        if self.unsupported:
            raise LinkUnsupported("the holder serves no links")
        return sum(b.nbytes for b in blocks)


@pytest.mark.parametrize("unsupported", [False, True], ids=["links", "old-holder"])
def test_puts_after_the_first_ride_the_link_or_sessions_for_a_holder_without_links(
    unsupported: bool,
) -> None:
    async def scenario() -> None:
        loop, peers, sender = FakeLoop(), FakePeers(), FakeSender(8)
        links = FakeLinks(unsupported)
        streams = CheckpointStreams(loop, INFO, peers, sender, ("tcp",), links=links)  # type: ignore[arg-type]
        plan = CheckpointPlan(holder_url="http://h", policy="every-1", lease_ttl_s=30.0)
        prompt = list(range(10, 19))
        replica = streams.open("r", plan, [*prompt, 50], len(prompt))
        assert replica is not None
        seen = on_tokens(replica, None)
        for token in range(51, 58):
            await asyncio.sleep(0)
            seen(_delta([token]))
        await until(lambda: replica.num_sent_blocks == 4)
        assert not replica.stopped  # no put was lost
        session = [p.first_version for p in _puts(peers)]
        if unsupported:
            # One link attempt, then sessions: this put and every later one.
            assert len(links.puts) == 1 and session == [4, 12, 16]
            assert streams.counters.num_link_puts == 0
        else:
            # The first put's reservation named the holder's TCP endpoint.
            assert session == [4] and [p.first_version for p in links.puts] == [12, 16]
            assert streams.counters.num_link_puts == 2
        await replica.close()
        await streams.aclose()

    asyncio.run(scenario())
