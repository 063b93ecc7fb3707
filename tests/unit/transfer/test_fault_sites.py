"""The transfer's fault sites: `InjectorStream` (transfer.send) applies an injector's rules to
the bytes, counted across streams; the receiver's `on_chunk` hook (transfer.recv_chunk) can
drop a connection, and in both cases the sender's retry still lands every byte."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
from memory_streams import memory_stream_pair

from pdserve.errors import PeerClosed, StreamBroken, TransferError, TransferRefused
from pdserve.faults import FaultInjector, FaultKind, FaultSite, Injection, parse_rules
from pdserve.transfer.backoff import BackoffPolicy
from pdserve.transfer.faulty import InjectorStream
from pdserve.transfer.messages import KVLayout, token_digest
from pdserve.transfer.receiver import ChunkHook, IncomingTransfer, KVReceiver
from pdserve.transfer.receiver_session import ReceivePlan
from pdserve.transfer.sender import OutgoingTransfer, SendPolicy, SendReport, send_with_retries
from pdserve.transfer.sender_session import SenderSession
from pdserve.transfer.stream import ByteStream

T = TypeVar("T")
FP = {"model": "tiny", "dtype": "float32", "kv_block_size": 16}
BLOCK_BYTES = 1024
NUM_BLOCKS = 6
FAST = SendPolicy(
    frame_bytes=2 * BLOCK_BYTES, chunk_timeout_s=0.5, backoff=BackoffPolicy(0.001, 0.005, 4)
)
SEND = FaultSite.TRANSFER_SEND


def run(body: Callable[[], Awaitable[T]]) -> T:
    async def bounded() -> T:
        async with asyncio.timeout(20):
            return await body()

    return asyncio.run(bounded())


async def read_all(stream: ByteStream) -> bytes:
    out = b""
    while chunk := await stream.receive_some():
        out += chunk
    return out


async def sent_through(rules: list[str], messages: list[bytes]) -> tuple[bytes, Exception | None]:
    """What the peer receives when `messages` are sent through an InjectorStream."""
    a, b = memory_stream_pair()
    stream = InjectorStream(a, FaultInjector(parse_rules(rules)))
    error: Exception | None = None
    try:
        for message in messages:
            await stream.send([message])
    except TransferError as exc:  # PeerClosed (close), StreamBroken (sends after truncate)
        error = exc
    await stream.aclose()
    return await read_all(b), error


def test_an_injector_stream_says_whether_a_rule_acted_on_it() -> None:
    """A pool reuses a stream after a clean attempt only if no fault touched it."""

    async def fired(rules: list[str]) -> bool:
        a, b = memory_stream_pair()
        stream = InjectorStream(a, FaultInjector(parse_rules(rules)))
        await stream.send([b"x"])
        await stream.aclose()
        await b.aclose()
        return stream.fired

    assert run(lambda: fired([])) is False
    assert run(lambda: fired(["transfer.send:delay:delay_s=0.001"])) is True
    assert run(lambda: fired(["transfer.send:drop:after=5"])) is False


def test_injector_stream_applies_each_byte_action_on_its_hit() -> None:
    messages = [b"hello", b"world", b"again"]
    assert run(lambda: sent_through([], messages)) == (b"helloworldagain", None)
    assert run(lambda: sent_through(["transfer.send:drop:after=1"], messages))[0] == b"helloagain"
    # Byte 2 of the second send, bit 2 % 8: "r" (0x72) ^ 0x04 = "v".
    corrupt = run(lambda: sent_through(["transfer.send:corrupt:after=1,offset=2"], messages))
    assert corrupt[0] == b"hellowovldagain"
    # truncate keeps a prefix and closes: the later sends go nowhere.
    truncated = run(lambda: sent_through(["transfer.send:truncate:after=1,offset=3"], messages))
    assert truncated[0] == b"hellowor" and isinstance(truncated[1], StreamBroken)
    data, error = run(lambda: sent_through(["transfer.send:close:after=2"], messages))
    assert data == b"helloworld"
    assert isinstance(error, PeerClosed) and "transfer.send:close" in str(error)
    delayed = run(lambda: sent_through(["transfer.send:delay:delay_s=0.01,times=0"], messages))
    assert delayed == (b"helloworldagain", None)


def test_injector_stream_counts_sends_across_streams() -> None:
    faults = FaultInjector(parse_rules(["transfer.send:drop:after=2"]))

    async def body() -> list[bytes]:
        received = []
        for _ in range(2):
            a, b = memory_stream_pair()
            stream = InjectorStream(a, faults)
            await stream.send([b"x"])
            await stream.send([b"y"])
            await stream.aclose()
            received.append(await read_all(b))
        return received

    assert run(body) == [b"xy", b"y"]  # the third send overall is the first of stream two
    assert faults.injected == [Injection(SEND, 2, FaultKind.DROP)]


def make_transfer(
    on_chunk: ChunkHook | None = None,
) -> tuple[OutgoingTransfer, KVReceiver, list[bytearray]]:
    rng = random.Random(3)
    src = [rng.randbytes(BLOCK_BYTES) for _ in range(NUM_BLOCKS)]
    layout = KVLayout(2, NUM_BLOCKS, BLOCK_BYTES, "float32", 16)
    tid, token, digest = os.urandom(16), b"t" * 16, token_digest(list(range(90)))
    transfer = OutgoingTransfer(
        tid, "req-1", 1, layout, 90, digest, token, [memoryview(s) for s in src]
    )
    receiver = KVReceiver(FP, on_chunk=on_chunk)  # type: ignore[arg-type]
    dest = [bytearray(BLOCK_BYTES) for _ in range(NUM_BLOCKS)]
    plan = ReceivePlan(tid, token, layout, "req-1", 90, digest)
    receiver.expect(IncomingTransfer(plan, [memoryview(d) for d in dest], lambda: None))
    return transfer, receiver, dest


async def send(
    transfer: OutgoingTransfer, receiver: KVReceiver, faults: FaultInjector | None
) -> SendReport:
    tasks: list[asyncio.Task[None]] = []

    async def connect() -> ByteStream:
        a, b = memory_stream_pair()
        tasks.append(asyncio.create_task(receiver.handle(b)))
        return a if faults is None else InjectorStream(a, faults)

    try:
        session = SenderSession(transfer.transfer_id, FP)
        return await send_with_retries(connect, session, transfer, FAST, deadline=1e12)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("action", ["corrupt", "truncate", "drop", "close"])
def test_a_send_fault_is_caught_and_the_retry_lands_every_byte(action: str) -> None:
    # Sends of an attempt: Hello, Begin, 3 chunks, Commit; after=3 hits the second chunk.
    faults = FaultInjector(parse_rules([f"transfer.send:{action}:after=3"]), seed=4)
    transfer, receiver, dest = make_transfer()
    report = run(lambda: send(transfer, receiver, faults))
    assert report.attempts == 2
    assert [bytes(d) for d in dest] == [bytes(v) for v in transfer.blocks]
    assert receiver.num_verified == 1
    assert faults.injected == [Injection(SEND, 3, FaultKind(action))]


def test_a_recv_chunk_hook_that_drops_the_connection_costs_one_attempt() -> None:
    calls: list[int] = []

    async def on_chunk() -> bool:
        calls.append(len(calls))
        return len(calls) != 2  # drop the connection at the second chunk, once

    transfer, receiver, dest = make_transfer(on_chunk)
    report = run(lambda: send(transfer, receiver, None))
    assert report.attempts == 2
    assert receiver.num_failed_attempts == 1
    assert [bytes(d) for d in dest] == [bytes(v) for v in transfer.blocks]
    assert len(calls) == 2 + 3  # two chunks of the lost attempt, three of the retry


def test_a_chunk_whose_reservation_went_away_during_the_hook_is_not_landed() -> None:
    transfer, receiver, dest = make_transfer()

    async def on_chunk() -> bool:
        await receiver.fence(transfer.transfer_id)  # cancelled while the chunk was held up
        return True

    receiver._on_chunk = on_chunk
    # The retry finds no reservation: refused, and nothing was ever written.
    with pytest.raises(TransferRefused, match="UNKNOWN_TRANSFER"):
        run(lambda: send(transfer, receiver, None))
    assert all(d == bytearray(BLOCK_BYTES) for d in dest)
