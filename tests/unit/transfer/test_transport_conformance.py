"""One conformance suite for every `ByteStream` transport, plus the fault wrapper's own tests.

Each test runs its coroutine under `asyncio.run` with a deadline, over loopback only; servers,
streams and subprocesses are closed at the end, and no shared-memory file may be left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import sys
import tempfile
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from memory_streams import memory_stream_pair

from pdlab.tls_certs import CertSet, make_cert_set
from pdserve.auth.tls import TLSConfig, client_context, server_context
from pdserve.errors import PeerClosed, StreamBroken
from pdserve.transfer.faulty import Fault, FaultAction, FaultPlan, FaultyStream
from pdserve.transfer.nixl_transport import (
    nixl_available,
    nixl_spares_settled,
    open_nixl_stream,
    serve_nixl,
)
from pdserve.transfer.shm import SEGMENT_PREFIX, leaked_segments, open_shm_stream, serve_shm
from pdserve.transfer.stream import ByteStream
from pdserve.transfer.tcp import open_tcp_stream, serve_tcp
from pdserve.transfer.tls_stream import open_tls_stream, serve_tls

REPO_ROOT = Path(__file__).resolve().parents[3]
LARGE_BYTES = 64 << 20
DEADLINE_S = 30.0

_no_nixl = pytest.mark.skipif(
    not nixl_available(), reason="nixl not importable (pip install --no-deps nixl nixl-cu12)"
)
TRANSPORTS = [
    "memory",
    "tcp",
    "shm",
    pytest.param("nixl", marks=_no_nixl),
    "faulty-memory",
    "tls",
]

Pair = tuple[ByteStream, ByteStream]


def run(test: Callable[[], Awaitable[None]], deadline_s: float = DEADLINE_S) -> None:
    """Run one async test body with a hard deadline."""

    async def bounded() -> None:
        async with asyncio.timeout(deadline_s):
            await test()

    asyncio.run(bounded())


@contextlib.asynccontextmanager
async def _served(serve: Any, open_stream: Any) -> AsyncIterator[Pair]:
    accepted: asyncio.Queue[ByteStream] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(stream: ByteStream) -> None:
        await accepted.put(stream)
        await done.wait()

    server = await serve(handler)
    client: ByteStream | None = None
    try:
        client = await open_stream(server.address)
        yield client, await accepted.get()
    finally:
        done.set()
        if client is not None:
            await client.aclose()
        await server.aclose()


@contextlib.asynccontextmanager
async def stream_pair(transport: str) -> AsyncIterator[Pair]:
    """A connected (a, b) pair over `transport`, closed on exit."""
    if transport in ("memory", "faulty-memory"):
        a: ByteStream
        b: ByteStream
        a, b = memory_stream_pair()
        if transport == "faulty-memory":
            a, b = FaultyStream(a, FaultPlan()), FaultyStream(b, FaultPlan())
        try:
            yield a, b
        finally:
            await a.aclose()
            await b.aclose()
        return
    if transport == "tls":
        certs = _tls_certs()
        config = TLSConfig(certs.cert, certs.key, certs.ca)
        server_ctx, client_ctx = server_context(config), client_context(config)
        assert server_ctx is not None and client_ctx is not None

        async def serve(handler: Any) -> Any:
            return await serve_tls(handler, "127.0.0.1", 0, server_ctx)

        async def open_tls(address: Any) -> ByteStream:
            return await open_tls_stream(address, client_ctx)

        async with _served(serve, open_tls) as pair:
            yield pair
        return
    serve, open_stream = {
        "tcp": (serve_tcp, open_tcp_stream),
        "shm": (serve_shm, open_shm_stream),
        "nixl": (serve_nixl, open_nixl_stream),
    }[transport]
    async with _served(serve, open_stream) as pair:
        yield pair


@functools.cache
def _tls_certs() -> CertSet:
    return make_cert_set(Path(tempfile.mkdtemp(prefix="pdserve-tls-")), "conformance")


def _own_segments() -> set[str]:
    # Segments carry their creator's pid: another test process's (make test runs two pytest
    # processes side by side) are not this test's leaks.
    return {n for n in leaked_segments() if n.startswith(f"{SEGMENT_PREFIX}{os.getpid()}-")}


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    before = _own_segments()
    yield
    assert _own_segments() - before == set()


_PATTERN: np.ndarray | None = None


def pattern(num_bytes: int) -> np.ndarray:
    """Bytes whose every 4-byte word is its own index, so reordering or loss shows."""
    global _PATTERN
    if _PATTERN is None:
        _PATTERN = np.arange(LARGE_BYTES // 4, dtype=np.uint32).view(np.uint8)
    return _PATTERN[:num_bytes]


def split_views(array: np.ndarray, cuts: list[int]) -> list[memoryview]:
    view = array.data
    edges = [0, *cuts, array.nbytes]
    return [view[lo:hi] for lo, hi in itertools.pairwise(edges)]


async def receive_exactly(stream: ByteStream, num_bytes: int) -> bytes:
    out = bytearray()
    while len(out) < num_bytes:
        chunk = await stream.receive_some(num_bytes - len(out))
        assert chunk, f"EOF after {len(out)} of {num_bytes} bytes"
        out += chunk
    return bytes(out)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_small_round_trip(transport: str) -> None:
    async def body() -> None:
        async with stream_pair(transport) as (a, b):
            await a.send([b"hello", memoryview(b" wor"), bytearray(b"ld")])
            out = bytearray(11)
            await b.receive_into(memoryview(out))
            assert out == b"hello world"
            await b.send([b"back"])
            assert await receive_exactly(a, 4) == b"back"

    run(body)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_large_payload_as_several_views(transport: str) -> None:
    payload = pattern(LARGE_BYTES)
    views = [memoryview(b"header--"), *split_views(payload, [1, 4097, 33 << 20])]
    out = np.zeros(8 + LARGE_BYTES, dtype=np.uint8)
    out.fill(0)  # pre-touch the destination

    async def body() -> None:
        async with stream_pair(transport) as (a, b):
            await asyncio.gather(a.send(views), b.receive_into(out.data))

    run(body)
    assert bytes(out[:8]) == b"header--"
    assert np.array_equal(out[8:], payload)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_receive_into_fills_exactly_the_view(transport: str) -> None:
    async def body() -> None:
        async with stream_pair(transport) as (a, b):
            await a.send([bytes(range(100))])
            buf = bytearray(b"\xff" * 50)
            await b.receive_into(memoryview(buf)[5:45])
            assert buf[:5] == b"\xff" * 5 and buf[45:] == b"\xff" * 5
            assert buf[5:45] == bytes(range(40))
            assert await receive_exactly(b, 60) == bytes(range(40, 100))

    run(body)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_many_small_messages_keep_order(transport: str) -> None:
    messages = [i.to_bytes(4, "little") * (1 + i % 16) for i in range(400)]
    expected = b"".join(messages)

    async def body() -> None:
        async with stream_pair(transport) as (a, b):

            async def sender() -> None:
                for message in messages:
                    await a.send([message])

            received, _ = await asyncio.gather(receive_exactly(b, len(expected)), sender())
            assert received == expected

    run(body)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_eof_after_data(transport: str) -> None:
    async def body() -> None:
        async with stream_pair(transport) as (a, b):
            await a.send([b"tail"])
            await a.aclose()
            assert await receive_exactly(b, 4) == b"tail"
            assert await b.receive_some() == b""
            assert await b.receive_some() == b""
            with pytest.raises(PeerClosed):
                await b.receive_into(memoryview(bytearray(1)))

    run(body)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_peer_close_mid_receive_raises_peer_closed(transport: str) -> None:
    async def body() -> None:
        async with stream_pair(transport) as (a, b):
            receiving = asyncio.ensure_future(b.receive_into(memoryview(bytearray(100))))
            await asyncio.sleep(0.01)
            await a.send([b"x" * 10])
            await a.aclose()
            with pytest.raises(PeerClosed):
                async with asyncio.timeout(5):
                    await receiving

    run(body)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_send_after_peer_close_raises_peer_closed(transport: str) -> None:
    async def body() -> None:
        async with stream_pair(transport) as (a, b):
            await a.aclose()
            chunk = bytes(1 << 20)
            with pytest.raises(PeerClosed):
                async with asyncio.timeout(10):
                    for _ in range(1000):  # TCP may buffer the first sends
                        await b.send([chunk])

    run(body)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_concurrent_send_and_receive_both_ways(transport: str) -> None:
    num_bytes = 8 << 20
    a_to_b = pattern(num_bytes)
    b_to_a = pattern(num_bytes)[::-1].copy()
    out_b = np.zeros(num_bytes, dtype=np.uint8)
    out_a = np.zeros(num_bytes, dtype=np.uint8)

    async def body() -> None:
        async with stream_pair(transport) as (a, b):
            await asyncio.gather(
                a.send(split_views(a_to_b, [3 << 20])),
                b.send(split_views(b_to_a, [5 << 20])),
                b.receive_into(out_b.data),
                a.receive_into(out_a.data),
            )

    run(body)
    assert np.array_equal(out_b, a_to_b) and np.array_equal(out_a, b_to_a)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_timed_out_receive_leaves_stream_usable(transport: str) -> None:
    async def body() -> None:
        async with stream_pair(transport) as (a, b):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await b.receive_some()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await b.receive_into(memoryview(bytearray(4)))
            await a.send([b"ping"])
            assert await receive_exactly(b, 4) == b"ping"

    run(body)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_timed_out_send_leaves_aclose_working(transport: str) -> None:
    payload = pattern(LARGE_BYTES).data

    async def body() -> None:
        async with stream_pair(transport) as (a, b):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await a.send([payload, payload])  # more than any buffer, nobody reads
            if transport.endswith("memory"):
                await a.send([b"more"])  # nothing was read: the send was withdrawn whole
            else:
                with pytest.raises(StreamBroken):
                    await a.send([b"more"])  # a prefix went out: the direction is broken
            async with asyncio.timeout(5):
                await a.aclose()
                await a.aclose()
                await b.aclose()

    run(body)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_aclose_wakes_local_receiver(transport: str) -> None:
    async def body() -> None:
        async with stream_pair(transport) as (_, b):
            receiving = asyncio.ensure_future(b.receive_some())
            await asyncio.sleep(0.01)
            await b.aclose()
            with pytest.raises(StreamBroken):
                async with asyncio.timeout(5):
                    await receiving
            with pytest.raises(StreamBroken):
                await b.send([b"x"])

    run(body)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_numpy_and_torch_memory_round_trip(transport: str) -> None:
    kv = torch.arange(2 * 4 * 1024, dtype=torch.float16).reshape(2, 4, 1024)
    array = np.linspace(0, 1, 3 * 1000, dtype=np.float32).reshape(3, 1000)
    kv_out = torch.zeros_like(kv)
    array_out = np.zeros_like(array)

    async def body() -> None:
        async with stream_pair(transport) as (a, b):
            sending = a.send([kv.numpy().data, array.data])
            await asyncio.gather(sending, b.receive_into(kv_out.numpy().data))
            await b.receive_into(array_out.data)

    run(body)
    assert torch.equal(kv, kv_out) and np.array_equal(array, array_out)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_no_python_copy_of_the_payload(transport: str) -> None:
    """A 64 MiB send + receive_into allocates far less than 64 MiB in Python."""
    payload = pattern(LARGE_BYTES)
    out = np.zeros(LARGE_BYTES, dtype=np.uint8)
    out.fill(0)
    peaks: list[int] = []

    async def body() -> None:
        async with stream_pair(transport) as (a, b):
            await a.send([b"warm"])
            await receive_exactly(b, 4)
            # A NIXL connection builds its replacement endpoint in a thread; that 64 MiB inbox
            # is not a copy of the payload, so let the build finish before counting.
            await nixl_spares_settled()
            tracemalloc.start()
            try:
                await asyncio.gather(a.send([payload.data]), b.receive_into(out.data))
                peaks.append(tracemalloc.get_traced_memory()[1])
            finally:
                tracemalloc.stop()

    run(body)
    assert np.array_equal(out, payload)
    assert peaks[0] < 8 << 20, f"peak Python allocation {peaks[0]} bytes"


_ECHO_CHILD = """
import asyncio, sys
from pdserve.transfer.{module} import {serve}

async def echo(stream):
    while data := await stream.receive_some(1 << 20):
        await stream.send([data])

async def main():
    server = await {serve}(echo)
    print(server.address[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.aclose()

asyncio.run(main())
"""


@pytest.mark.parametrize(
    ("module", "serve", "open_stream"),
    [
        ("shm", "serve_shm", open_shm_stream),
        pytest.param("nixl_transport", "serve_nixl", open_nixl_stream, marks=_no_nixl),
    ],
)
def test_echo_across_processes(module: str, serve: str, open_stream: Any) -> None:
    payload = pattern(16 << 20)
    out = np.zeros(payload.nbytes, dtype=np.uint8)

    async def body() -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _ECHO_CHILD.format(module=module, serve=serve),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        try:
            assert child.stdout is not None and child.stdin is not None
            port = int(await child.stdout.readline())
            stream = await open_stream(("127.0.0.1", port))
            try:
                await asyncio.gather(
                    stream.send(split_views(payload, [7, 1 << 20])),
                    stream.receive_into(out.data),
                )
            finally:
                await stream.aclose()
            child.stdin.close()
            assert await asyncio.wait_for(child.wait(), 10) == 0
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()

    run(body, deadline_s=60)
    assert np.array_equal(out, payload)


# ---- faulty.py: each action has an observable effect; a seed fixes the effect ----


def _faulty_pair(plan: FaultPlan, sleeps: list[float] | None = None) -> tuple[FaultyStream, Any]:
    a, b = memory_stream_pair(capacity_bytes=64 << 20)

    async def record(seconds: float) -> None:
        if sleeps is not None:
            sleeps.append(seconds)

    return FaultyStream(a, plan, sleep=record), b


def test_fault_delay_sleeps_then_delivers() -> None:
    sleeps: list[float] = []
    plan = FaultPlan(faults=(Fault(FaultAction.DELAY, send_index=0),), delay_s=0.25)

    async def body() -> None:
        a, b = _faulty_pair(plan, sleeps)
        await a.send([b"late"])
        assert await receive_exactly(b, 4) == b"late"

    run(body)
    assert sleeps == [0.25]


def test_fault_drop_swallows_one_send() -> None:
    plan = FaultPlan(faults=(Fault(FaultAction.DROP, send_index=1),))

    async def body() -> None:
        a, b = _faulty_pair(plan)
        for message in (b"one", b"two", b"three"):
            await a.send([message])
        await a.aclose()
        assert await receive_exactly(b, 8) == b"onethree"
        assert await b.receive_some() == b""

    run(body)


def test_fault_corrupt_flips_one_bit_and_spares_the_caller() -> None:
    payload = pattern(16 << 20).copy()
    original = payload.copy()
    out = np.zeros_like(payload)
    plan = FaultPlan(faults=(Fault(FaultAction.CORRUPT, send_index=0),), seed=7)

    async def body() -> None:
        inner, b = memory_stream_pair(capacity_bytes=0)
        a = FaultyStream(inner, plan)
        tracemalloc.start()
        try:
            await asyncio.gather(a.send(split_views(payload, [1000])), b.receive_into(out.data))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, "corrupt must not copy the whole buffer"
        (fault,) = a.injected
        diff = np.flatnonzero(out != payload)
        assert diff.tolist() == [fault.byte_offset]
        assert int(out[fault.byte_offset] ^ payload[fault.byte_offset]) == 1 << fault.bit

    run(body)
    assert np.array_equal(payload, original)
    assert plan.fault_for(0, payload.nbytes) == plan.fault_for(0, payload.nbytes)


def test_fault_truncate_sends_a_prefix_then_closes() -> None:
    plan = FaultPlan(faults=(Fault(FaultAction.TRUNCATE, send_index=0, byte_offset=300),))

    async def body() -> None:
        a, b = _faulty_pair(plan)
        await a.send([bytes(range(200)), bytes(range(200))])
        assert await receive_exactly(b, 300) == bytes(range(200)) + bytes(range(100))
        with pytest.raises(PeerClosed):
            await b.receive_into(memoryview(bytearray(1)))
        with pytest.raises(StreamBroken):
            await a.send([b"after"])

    run(body)


def test_fault_close_raises_and_gives_peer_eof() -> None:
    plan = FaultPlan(faults=(Fault(FaultAction.CLOSE, send_index=1),))

    async def body() -> None:
        a, b = _faulty_pair(plan)
        await a.send([b"first"])
        with pytest.raises(PeerClosed):
            await a.send([b"second"])
        assert await receive_exactly(b, 5) == b"first"
        assert await b.receive_some() == b""

    run(body)


def test_fault_stall_blocks_until_the_deadline() -> None:
    plan = FaultPlan(faults=(Fault(FaultAction.STALL, send_index=0),))

    async def body() -> None:
        a, b = _faulty_pair(plan)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await a.send([b"never"])
        await a.send([b"next"])
        assert await receive_exactly(b, 4) == b"next"

    run(body)


def test_fault_plan_is_deterministic_per_seed() -> None:
    def injected(seed: int) -> list[Any]:
        plan = FaultPlan(probability=0.2, seed=seed, actions=(FaultAction.CORRUPT,))
        return [f for i in range(500) if (f := plan.fault_for(i, 4096)) is not None]

    first = injected(1)
    assert first == injected(1)
    assert first != injected(2)
    assert 50 <= len(first) <= 150
    assert FaultPlan(probability=0.0).fault_for(0, 10) is None


def test_fault_probability_plan_applies_the_same_faults_in_two_runs() -> None:
    plan = FaultPlan(probability=0.3, seed=11, actions=(FaultAction.DROP, FaultAction.CORRUPT))

    async def one_run() -> tuple[list[Any], bytes]:
        a, b = _faulty_pair(plan)
        for i in range(50):
            await a.send([i.to_bytes(2, "little") * 8])
        await a.aclose()
        received = bytearray()
        while chunk := await b.receive_some():
            received += chunk
        return a.injected, bytes(received)

    results: list[tuple[list[Any], bytes]] = []

    async def body() -> None:
        results.append(await one_run())
        results.append(await one_run())

    run(body)
    assert results[0] == results[1]
    assert results[0][0] and len(results[0][1]) < 50 * 16  # some sends were dropped
