"""Checkpoint replication links end to end over loopback TCP: the writer's `CheckpointLinks`,
the holder's `LinkServer` behind a real `KVReceiver`, and its `CheckpointStore`.

What a user relies on: a put is held with its bytes, chain and value digest; a refused put
leaves the link usable; a holder that closed an idle link costs one reconnect, not a lost put;
damage, a foreign engine or a foreign cluster is refused and nothing is held; a paused writer
whose owner lease lapsed cannot extend a chain that is gone; nothing stays reserved.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
from waiting import until

from pdserve.checkpoint.host_tier import HostTier
from pdserve.clock import FakeClock
from pdserve.engine.block_manager import hash_block_tokens, prefix_block_hashes
from pdserve.errors import (
    CheckpointRefused,
    LinkUnsupported,
    TransferError,
    TransferRefused,
    TransferTimeout,
)
from pdserve.transfer.messages import Put
from pdserve.transfer.receiver import KVReceiver, ReceiverLimits
from pdserve.transfer.stream import Address, Buffer, ByteStream
from pdserve.transfer.tcp import open_tcp_stream, serve_tcp
from pdserve.worker.checkpoint.link import CheckpointLinks
from pdserve.worker.checkpoint.link_server import LinkServer
from pdserve.worker.checkpoint.store import CheckpointStore
from pdserve.worker.engine_loop import EngineInfo

BS = 4
BLOCK_BYTES = 4096
INFO = EngineInfo({"model": "m", "block_size": BS}, "fp-a", 1, BS, BLOCK_BYTES, "f32", 64, 1024)
KEY = b"s" * 32
TOKENS = list(range(100, 100 + 4 * BS))


def block(i: int) -> bytes:
    return bytes([i + 1]) * BLOCK_BYTES


def put_of(i: int, owner: str = "req-1", ttl: float = 30.0, digest: bytes = b"") -> Put:
    """The put of block i of TOKENS, continuing the chain of blocks [0, i)."""
    parent = 0
    for j in range(i):
        parent = hash_block_tokens(parent, TOKENS[j * BS : (j + 1) * BS])
    return Put(owner, parent, (i + 1) * BS, tuple(TOKENS[i * BS : (i + 1) * BS]), ttl, digest)


class Holder:
    """A holder serving links on loopback: its store (on a fake clock: owner leases lapse when
    a test advances it), link server and TCP server."""

    def __init__(self, info: EngineInfo, key: bytes | None, idle_timeout_s: float) -> None:
        self.tier = HostTier(1 << 20, BS, BLOCK_BYTES)
        self.clock = FakeClock()
        limits = ReceiverLimits(idle_timeout_s=idle_timeout_s, frame_timeout_s=2.0)
        self.receiver = KVReceiver(info.fingerprint, cluster_key=key, limits=limits)
        self.store = CheckpointStore(
            self.tier,
            info,
            self.receiver,
            list,
            None,  # type: ignore[arg-type]
            clock=self.clock.now,
        )
        self.links = LinkServer(self.store, info, key, limits)
        # Links whose serving ended (the holder closed them), for tests to wait on.
        self.num_links_ended = 0
        self.receiver.link_handler = self._serve

    async def _serve(self, *args: Any) -> None:
        try:
            await self.links.serve(*args)
        finally:
            self.num_links_ended += 1

    async def __aenter__(self) -> Holder:
        self.server = await serve_tcp(self.receiver.handle)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.aclose()

    @property
    def address(self) -> Address:
        return self.server.address

    def held(self, num_blocks: int) -> list[bytes]:
        hashes = prefix_block_hashes(TOKENS[: num_blocks * BS], BS)
        return [bytes(v) for v in self.tier.read(hashes, "fp-a")]


def run(
    body: Callable[[Holder, CheckpointLinks], Awaitable[None]],
    *,
    holder_info: EngineInfo = INFO,
    holder_key: bytes | None = KEY,
    writer_key: bytes | None = KEY,
    idle_timeout_s: float = 30.0,
    connect: Callable[[str, Address], Awaitable[ByteStream]] | None = None,
) -> None:
    async def main() -> None:
        async with Holder(holder_info, holder_key, idle_timeout_s) as holder:
            links = CheckpointLinks(INFO, writer_key, connect, timeout_s=2.0)  # type: ignore[arg-type]
            try:
                await body(holder, links)
            finally:
                await links.aclose()
            holder.tier.check_invariants()

    asyncio.run(asyncio.wait_for(main(), 30))


def views(*blocks: bytes) -> list[memoryview]:
    return [memoryview(b) for b in blocks]


def test_puts_on_one_link_are_held_with_their_bytes_chain_and_value_digest() -> None:
    async def body(holder: Holder, links: CheckpointLinks) -> None:
        assert await links.put(holder.address, put_of(0), views(block(0))) == BLOCK_BYTES
        both = Put("req-1", put_of(1).parent_hash, 2 * BS, tuple(TOKENS[BS : 3 * BS]), 30.0, b"d")
        assert await links.put(holder.address, both, views(block(1), block(2))) == 2 * BLOCK_BYTES
        assert holder.held(3) == [block(0), block(1), block(2)]
        last = prefix_block_hashes(TOKENS[: 3 * BS], BS)[-1]
        assert holder.tier.value_digest(last) == b"d"
        assert links.num_opened == 1 and holder.links.num_links == 1
        assert holder.links.puts["held"] == 2
        assert holder.tier.reserved_bytes == 0

    run(body)


def test_a_refused_put_leaves_the_link_usable_and_nothing_reserved() -> None:
    async def body(holder: Holder, links: CheckpointLinks) -> None:
        with pytest.raises(CheckpointRefused, match="not held"):
            await links.put(holder.address, put_of(2), views(block(2)))  # no parent held
        await links.put(holder.address, put_of(0), views(block(0)))
        assert links.num_opened == 1
        assert holder.links.puts == {"chain": 1, "held": 1}
        assert holder.tier.reserved_bytes == 0

    run(body)


def test_a_put_whose_tokens_and_bytes_disagree_is_refused_as_a_bad_version() -> None:
    async def body(holder: Holder, links: CheckpointLinks) -> None:
        with pytest.raises(CheckpointRefused, match="whole blocks"):
            await links.put(holder.address, put_of(0), views(block(0), block(1)))
        assert holder.tier.refused["version"] == 1 and holder.tier.num_blocks == 0

    run(body)


def test_a_writer_paused_past_its_owner_lease_cannot_extend_the_chain() -> None:
    async def body(holder: Holder, links: CheckpointLinks) -> None:
        await links.put(holder.address, put_of(0, ttl=0.05), views(block(0)))
        holder.clock.advance(0.1)  # the writer is stopped; its lease lapses
        assert holder.store.reap() == 1 and holder.tier.num_blocks == 0
        with pytest.raises(CheckpointRefused):
            await links.put(holder.address, put_of(1), views(block(1)))  # it wakes up
        assert holder.tier.num_blocks == 0 and holder.tier.reserved_bytes == 0

    run(body)


def test_an_idle_link_the_holder_closed_costs_a_reconnect_not_a_put() -> None:
    async def body(holder: Holder, links: CheckpointLinks) -> None:
        await links.put(holder.address, put_of(0), views(block(0)))
        # Past the holder's idle timeout: it closed the link.
        await until(lambda: holder.num_links_ended == 1, what="the holder closed the idle link")
        await links.put(holder.address, put_of(1), views(block(1)))
        assert links.num_opened == 2
        assert holder.held(2) == [block(0), block(1)]

    run(body, idle_timeout_s=0.2)


@pytest.mark.parametrize(
    ("holder_info", "holder_key", "match"),
    [
        (
            EngineInfo(
                {"model": "m", "block_size": 8}, "fp-b", 1, BS, BLOCK_BYTES, "f32", 64, 1024
            ),
            KEY,
            "FINGERPRINT_MISMATCH",
        ),
        (INFO, b"other-cluster" * 3, "UNAUTHENTICATED"),
    ],
    ids=["other-engine", "other-cluster"],
)
def test_a_holder_of_another_engine_or_cluster_gets_no_put(
    holder_info: EngineInfo, holder_key: bytes, match: str
) -> None:
    async def body(holder: Holder, links: CheckpointLinks) -> None:
        with pytest.raises(TransferRefused, match=match):
            await links.put(holder.address, put_of(0), views(block(0)))
        assert holder.tier.num_blocks == 0 and holder.links.num_links == 0
        if match == "FINGERPRINT_MISMATCH":
            assert holder.tier.refused["fingerprint"] == 1

    run(body, holder_info=holder_info, holder_key=holder_key)


class _Flipping(ByteStream):
    """A TCP stream that flips one byte of every large buffer it sends (damage in flight)."""

    def __init__(self, inner: ByteStream) -> None:
        self._inner = inner

    async def send(self, buffers: Sequence[Buffer]) -> None:
        out: list[Buffer] = []
        for buf in buffers:
            if len(memoryview(buf)) >= BLOCK_BYTES:
                damaged = bytearray(buf)
                damaged[BLOCK_BYTES // 2] ^= 0xFF
                buf = bytes(damaged)
            out.append(buf)
        await self._inner.send(out)

    async def receive_into(self, view: memoryview) -> None:
        await self._inner.receive_into(view)

    async def receive_some(self, max_bytes: int = 1 << 16) -> bytes:
        return await self._inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self._inner.aclose()


def test_data_damaged_in_flight_is_refused_and_nothing_is_held() -> None:
    async def flipping(transport: str, address: Address) -> ByteStream:
        return _Flipping(await open_tcp_stream(address))

    async def body(holder: Holder, links: CheckpointLinks) -> None:
        with pytest.raises(TransferRefused, match="CHECKSUM_MISMATCH"):
            await links.put(holder.address, put_of(0), views(block(0)))
        assert holder.tier.refused["checksum"] == 1
        assert holder.tier.num_blocks == 0 and holder.tier.reserved_bytes == 0

    run(body, connect=flipping)


@pytest.mark.parametrize("yields", [0, 1, 2, 3, 5, 8])
def test_a_put_cancelled_anywhere_leaves_a_working_link_and_nothing_reserved(yields: int) -> None:
    async def body(holder: Holder, links: CheckpointLinks) -> None:
        task = asyncio.create_task(links.put(holder.address, put_of(0), views(block(0))))
        for _ in range(yields):
            await asyncio.sleep(0)
        task.cancel()
        # Done before the cancel, or cancelled somewhere in the middle.
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await links.put(holder.address, put_of(0), views(block(0)))  # idempotent if held
        await links.put(holder.address, put_of(1), views(block(1)))
        assert holder.held(2) == [block(0), block(1)]
        # A landing the cancel cut short gives its room back.
        await until(lambda: holder.tier.reserved_bytes == 0)

    run(body)


def test_a_direct_put_whose_owner_was_released_while_its_bytes_arrived_is_not_held() -> None:
    tier = HostTier(1 << 20, BS, BLOCK_BYTES)
    store = CheckpointStore(tier, INFO, None, list, None)  # type: ignore[arg-type]
    pending = store.begin_put("req-1", 0, BS, [TOKENS[:BS]], 30.0)
    store.release("req-1")  # the request ended while the bytes flew
    assert not store.finish_put(pending, True, b"")
    assert tier.num_blocks == 0 and tier.reserved_bytes == 0
    tier.check_invariants()


def test_puts_to_a_silent_holder_fail_fast_after_the_first_timeout() -> None:
    """A paused holder: the first put waits out its timeout, those queued behind it and
    those right after fail at once instead of each waiting its own."""

    async def main() -> None:
        async def silent(stream: ByteStream) -> None:
            await asyncio.sleep(30)  # accepts the connection, never answers

        server = await serve_tcp(silent)
        links = CheckpointLinks(INFO, KEY, timeout_s=0.3)
        loop = asyncio.get_running_loop()
        try:
            started = loop.time()
            puts = [links.put(server.address, put_of(i), views(block(i))) for i in range(5)]
            results = await asyncio.gather(*puts, return_exceptions=True)
            assert all(isinstance(r, TransferError) for r in results), results
            assert loop.time() - started < 1.0  # one timeout, not five
            assert isinstance(results[0], TransferTimeout)
            assert all("failed" in str(r) for r in results[1:])
        finally:
            await links.aclose()
            await server.aclose()

    asyncio.run(asyncio.wait_for(main(), 20))


def test_a_put_asking_for_a_lease_past_the_bound_is_refused_and_pins_nothing() -> None:
    async def body(holder: Holder, links: CheckpointLinks) -> None:
        with pytest.raises(CheckpointRefused, match="exceeds"):
            await links.put(holder.address, put_of(0, ttl=1e9), views(block(0)))
        assert holder.tier.num_blocks == 0 and holder.links.puts == {"lease": 1}
        await links.put(holder.address, put_of(0), views(block(0)))  # the link goes on

    run(body)


def test_a_holder_that_serves_no_links_says_so_at_the_handshake() -> None:
    """An older build's receiver takes the link id for an unknown transfer: the writer gets
    LinkUnsupported (and falls back to sessions for that holder, test_checkpoint_stream)."""

    async def body(holder: Holder, links: CheckpointLinks) -> None:
        holder.receiver.link_handler = None
        with pytest.raises(LinkUnsupported):
            await links.put(holder.address, put_of(0), views(block(0)))
        assert holder.tier.num_blocks == 0

    run(body)


def test_a_link_meant_for_a_previous_life_of_the_holder_is_refused_as_such() -> None:
    """The holder restarted at the same address: the writer's Hello names the instance its
    last reservation came from, and the new life refuses it as stale (STALE_INSTANCE, not
    retried) before anything is put; named as the instance it is, the link goes on."""

    async def body(holder: Holder, links: CheckpointLinks) -> None:
        holder.receiver.instance = bytes.fromhex("b2" * 8)
        with pytest.raises(TransferRefused, match=r"STALE_INSTANCE.*a1a1a1a1a1a1a1a1") as info:
            await links.put(holder.address, put_of(0), views(block(0)), bytes.fromhex("a1" * 8))
        assert not info.value.retryable and holder.tier.num_blocks == 0
        await links.put(holder.address, put_of(0), views(block(0)), bytes.fromhex("b2" * 8))
        assert holder.tier.num_blocks == 1

    run(body)
