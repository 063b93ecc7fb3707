"""No write after the lease (invariant 7), driven through the real `KVReceiver`.

A hypothesis state machine interleaves what a sender may do (land some bytes, pause, resume,
reconnect with a new attempt) with what time and the owner do (the lease expires; the owner
fences the transfer and gives its blocks to another request, which writes its own KV there).
Whatever the order: once the blocks belong to the other request they hold exactly its bytes,
the old transfer is never verified afterwards, and a reconnecting stale sender is refused.
Plus the specific cases: a new attempt fences the previous connection before it may write;
`fence` returns only once the writer has ended; every landed piece renews the lease; a silent
connection is dropped at the handshake and frame deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from memory_streams import memory_stream_pair
from waiting import until

from pdserve.clock import FakeClock
from pdserve.errors import LeaseError
from pdserve.transfer.codec import Envelope, data_checksum, encode
from pdserve.transfer.framing import read_frame
from pdserve.transfer.lease import LeaseTable
from pdserve.transfer.messages import (
    PROTOCOL_VERSION,
    Begin,
    Chunk,
    Commit,
    Hello,
    KVLayout,
    Nack,
    NackCode,
    Role,
    commit_digest,
    token_digest,
)
from pdserve.transfer.receiver import IncomingTransfer, KVReceiver, ReceiverLimits
from pdserve.transfer.receiver_session import ReceivePlan
from pdserve.transfer.stream import ByteStream

FP = {"model": "tiny"}
BLOCK_BYTES = 96
NUM_BLOCKS = 3
FRAME_BYTES = 70  # chunks that cut blocks anywhere
TOKEN = b"t" * 16
PROMPT = list(range(40))
TTL = 1.0


def sender_frames(tid: bytes, attempt: int, epoch: int, payload: bytes) -> bytes:
    """Every byte one attempt of a well-behaved sender puts on the wire, in order."""
    layout = KVLayout(2, NUM_BLOCKS, BLOCK_BYTES, "float32", 16)
    seq = iter(range(100))

    def frame(message: object, data: bytes | None = None) -> bytes:
        envelope = Envelope(tid, attempt, next(seq))
        return b"".join(bytes(p) for p in encode(message, data, envelope=envelope))  # type: ignore[arg-type]

    out = frame(Hello(PROTOCOL_VERSION, Role.PREFILL, FP))
    begin = Begin(tid, "req-a", 1, layout, len(PROMPT), token_digest(PROMPT), TOKEN, epoch)
    out += frame(begin)
    chunks = []
    for offset in range(0, len(payload), FRAME_BYTES):
        data = payload[offset : offset + FRAME_BYTES]
        chunk = Chunk(offset, len(data), data_checksum([data]))
        chunks.append(chunk)
        out += frame(chunk, data)
    out += frame(Commit(commit_digest(chunks), len(chunks), len(payload)))
    return out


class Owner:
    """What a decode worker does around one reservation: lease, expect, fence, reuse."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.table = LeaseTable(self.clock)
        self.memory = [bytearray(BLOCK_BYTES) for _ in range(NUM_BLOCKS)]
        self.receiver = KVReceiver(FP, limits=ReceiverLimits(5.0, 5.0, 5.0))
        self.tid = os.urandom(16)
        self.lease = self.table.grant(range(NUM_BLOCKS), TTL, "reservation a")
        self.verified_at: float | None = None
        plan = ReceivePlan(
            self.tid, TOKEN, KVLayout(2, NUM_BLOCKS, BLOCK_BYTES, "float32", 16), "req-a",
            len(PROMPT), token_digest(PROMPT), epoch=self.lease.epoch,
        )  # fmt: skip
        self.receiver.expect(
            IncomingTransfer(
                plan,
                [memoryview(b) for b in self.memory],
                on_verified=self._verified,
                guard=lambda: self.table.check(self.lease.lease_id, self.lease.epoch),
                on_progress=self._progress,
            )
        )

    def _verified(self) -> None:
        self.verified_at = self.clock.now()

    def _progress(self) -> None:
        self.table.renew(self.lease.lease_id, self.lease.epoch, TTL)

    async def expire_and_reuse(self, pattern: int) -> None:
        """The lease lapsed: fence the writer, free the blocks, another request writes them."""
        assert self.table.expire() or self.table.num_active == 0
        await self.receiver.fence(self.tid)
        for block in self.memory:
            block[:] = bytes([pattern]) * BLOCK_BYTES


class Connection:
    """One sender connection: its end of a stream pair and the receiver task on the other."""

    def __init__(self, receiver: KVReceiver, wire: bytes) -> None:
        self.ours, theirs = memory_stream_pair()
        self.wire = wire
        self.sent = 0

        async def serve(stream: ByteStream) -> None:
            try:
                await receiver.handle(stream)
            finally:
                await stream.aclose()  # as a server does once its handler ends

        self.task = asyncio.get_running_loop().create_task(serve(theirs))

    async def send(self, num_bytes: int) -> bool:
        """Send the next bytes; False once the connection refuses them."""
        piece = self.wire[self.sent : self.sent + num_bytes]
        if not piece:
            return True
        try:
            async with asyncio.timeout(0.5):
                await self.ours.send([piece])
        except Exception:  # closed by the receiver (fenced or refused): bytes went nowhere
            return False
        self.sent += len(piece)
        return True


async def settle() -> None:
    for _ in range(30):
        await asyncio.sleep(0)


class FencingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        # Distinct bytes everywhere, so a chunk's data is found in the wire unambiguously.
        self.payload = bytes((i * 37 + 11) % 251 for i in range(NUM_BLOCKS * BLOCK_BYTES))
        self.owner = self.run(self._owner())
        self.attempt = 1
        self.conn = self.run(self._connect())
        self.paused = False
        self.reused = False
        self.refused_stale = False

    def run(self, coro: object) -> object:  # type: ignore[misc]
        return self.loop.run_until_complete(coro)  # type: ignore[arg-type]

    async def _owner(self) -> Owner:
        return Owner()

    async def _connect(self) -> Connection:
        wire = sender_frames(self.owner.tid, self.attempt, self.owner.lease.epoch, self.payload)
        return Connection(self.owner.receiver, wire)

    @rule(num_bytes=st.integers(1, 200))
    @precondition(lambda self: not self.paused)
    def land(self, num_bytes: int) -> None:
        async def go() -> None:
            await self.conn.send(num_bytes)
            await settle()

        self.run(go())

    @rule(fraction=st.floats(0.05, 0.95))
    @precondition(lambda self: not self.paused)
    def land_into_the_middle_of_the_next_chunk(self, fraction: float) -> None:
        """Stop inside the data of the next chunk: the moment a pause or a stall hurts most."""
        wire, payload = self.conn.wire, self.payload
        for offset in range(0, len(payload), FRAME_BYTES):
            data = payload[offset : offset + FRAME_BYTES]
            start = wire.find(data, self.conn.sent)
            if start >= 0:
                target = start + max(1, int(len(data) * fraction))
                self.land(target - self.conn.sent)
                return

    @rule()
    def pause(self) -> None:
        self.paused = True

    @rule()
    def resume(self) -> None:
        self.paused = False

    @rule()
    @precondition(lambda self: not self.reused)
    def time_passes_past_the_ttl(self) -> None:
        self.owner.clock.advance(TTL + 0.1)
        if self.owner.table.num_active == 0 and self.owner.verified_at is not None:
            return  # nothing left to expire
        self.run(self.owner.expire_and_reuse(0xBB))
        self.reused = True

    @rule()
    @precondition(lambda self: not self.reused)
    def time_passes_within_the_ttl(self) -> None:
        self.owner.clock.advance(TTL / 3)
        if self.owner.verified_at is None:
            self.owner.table.expire()  # the reaper runs; a live lease is untouched

    @rule()
    def reconnect_with_a_new_attempt(self) -> None:
        self.attempt += 1
        self.conn = self.run(self._connect())

        async def hello() -> None:
            await self.conn.send(len(self.conn.wire))
            await settle()
            if self.reused:
                # A stale sender's new attempt: the transfer is gone, it is told so.
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(0.5):
                        _, reply = await read_frame(self.conn.ours)
                        assert isinstance(reply, Nack), reply
                        assert reply.code is NackCode.UNKNOWN_TRANSFER
                        self.refused_stale = True

        self.run(hello())

    @invariant()
    def reused_blocks_hold_only_their_new_owners_bytes(self) -> None:
        if self.reused:
            assert all(bytes(b) == b"\xbb" * BLOCK_BYTES for b in self.owner.memory)

    @invariant()
    def verified_only_while_leased_and_with_the_right_bytes(self) -> None:
        verified = self.owner.verified_at
        if verified is not None and not self.reused:
            assert b"".join(self.owner.memory) == self.payload

    def teardown(self) -> None:
        async def close() -> None:
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
            await settle()

        self.run(close())
        self.loop.close()


TestFencing = FencingMachine.TestCase
TestFencing.settings = settings(max_examples=80, stateful_step_count=20, deadline=None)


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_a_new_attempt_fences_the_previous_connection_before_it_writes() -> None:
    async def body() -> None:
        owner = Owner()
        payload = bytes(range(256)) * 2
        payload = payload[: NUM_BLOCKS * BLOCK_BYTES]
        old = Connection(owner.receiver, sender_frames(owner.tid, 1, owner.lease.epoch, payload))
        # Attempt 1 stops in the middle of a chunk's data (a stalled link).
        cut = old.wire.index(payload[:FRAME_BYTES]) + FRAME_BYTES // 2
        await old.send(cut)
        await settle()
        new = Connection(owner.receiver, sender_frames(owner.tid, 2, owner.lease.epoch, payload))
        await new.send(len(new.wire))
        await settle()
        assert owner.verified_at is not None
        assert old.task.done()  # cancelled, and ended, before attempt 2 could land anything
        # The stalled attempt's remaining bytes go nowhere.
        assert not await old.send(len(old.wire))
        assert b"".join(owner.memory) == payload
        assert owner.receiver.num_fenced_writers == 1

    run(body())


def test_fence_returns_only_once_the_writer_has_ended() -> None:
    async def body() -> None:
        owner = Owner()
        payload = bytes(NUM_BLOCKS * BLOCK_BYTES)
        conn = Connection(owner.receiver, sender_frames(owner.tid, 1, owner.lease.epoch, payload))
        await conn.send(len(conn.wire) // 2)  # mid-transfer
        await settle()
        assert not conn.task.done()
        await owner.receiver.fence(owner.tid)
        assert conn.task.done()  # the writer is gone: blocks may be freed now
        assert owner.receiver.num_expected == 0

    run(body())


def test_a_begin_with_an_old_epoch_is_refused() -> None:
    async def body() -> None:
        owner = Owner()
        payload = bytes(NUM_BLOCKS * BLOCK_BYTES)
        wire = sender_frames(owner.tid, 1, owner.lease.epoch - 1, payload)
        conn = Connection(owner.receiver, wire)
        await conn.send(len(wire))
        await settle()
        assert owner.verified_at is None
        assert owner.receiver.failed_attempts_by_reason["StaleLease"] == 1

    run(body())


def test_landing_bytes_renews_the_lease_and_silence_lets_it_lapse() -> None:
    async def body() -> None:
        owner = Owner()
        payload = bytes((i * 7 + 1) % 256 for i in range(NUM_BLOCKS * BLOCK_BYTES))
        conn = Connection(owner.receiver, sender_frames(owner.tid, 1, owner.lease.epoch, payload))
        # Hello and Begin at once (while a prefill runs, the router's /renew covers this).
        await conn.send(conn.wire.index(payload[:FRAME_BYTES]))
        step = 40
        while conn.sent < len(conn.wire) - 200:
            owner.clock.advance(TTL * 0.3)  # each step alone is within the TTL...
            await conn.send(step)
            await settle()
            assert owner.table.expire() == []  # ...and the bytes keep renewing it
        owner.clock.advance(TTL * 1.5)  # then silence
        assert len(owner.table.expire()) == 1
        with pytest.raises(LeaseError):
            owner.table.check(owner.lease.lease_id, owner.lease.epoch)

    run(body())


def test_a_connection_that_never_says_hello_is_dropped_at_the_handshake_deadline() -> None:
    async def body() -> None:
        receiver = KVReceiver(FP, limits=ReceiverLimits(handshake_timeout_s=0.05))
        ours, theirs = memory_stream_pair()
        task = asyncio.get_running_loop().create_task(receiver.handle(theirs))
        await ours.send([b"PD"])  # two bytes, then nothing
        await asyncio.wait_for(task, 2.0)  # ended on its own

    run(body())


def test_the_server_closes_connections_over_its_cap_at_once() -> None:
    from pdserve.transfer.tcp import open_tcp_stream, serve_tcp

    async def body() -> None:
        release = asyncio.Event()
        served: list[ByteStream] = []

        async def handler(stream: ByteStream) -> None:
            served.append(stream)
            await release.wait()

        server = await serve_tcp(handler, max_connections=2)
        try:
            kept = [await open_tcp_stream(server.address) for _ in range(2)]
            await until(lambda: len(served) == 2, what="both kept connections accepted")
            extra = await open_tcp_stream(server.address)
            # Closed on arrival: the extra connection reads end of stream at once.
            async with asyncio.timeout(2):
                assert await extra.receive_some() == b""
            assert server.num_refused == 1
            for stream in (*kept, extra):
                await stream.aclose()
        finally:
            release.set()
            await server.aclose()

    run(body())
