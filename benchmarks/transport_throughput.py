"""Throughput of each `ByteStream` transport for 4, 64 and 256 MiB sends, side by side.

Two settings: both ends in one event loop (what the conformance tests exercise), and the
receiver in a child process (what a prefill → decode handoff on one host looks like). Each cell
is the best of `--repeats` timed sends after one warm-up, from the first byte sent to the
receiver's one-byte acknowledgement; buffers on both sides are pre-touched.

    .venv/bin/python benchmarks/transport_throughput.py [--repeats 3] [--sizes-mib 4 64 256]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from pdserve.transfer.memory import memory_stream_pair  # noqa: E402
from pdserve.transfer.nixl_transport import nixl_available  # noqa: E402
from pdserve.transfer.stream import ByteStream  # noqa: E402

MIB = 1 << 20
SERVED = {
    "tcp": ("pdserve.transfer.tcp", "serve_tcp", "open_tcp_stream"),
    "shm": ("pdserve.transfer.shm", "serve_shm", "open_shm_stream"),
    "nixl": ("pdserve.transfer.nixl_transport", "serve_nixl", "open_nixl_stream"),
}

_CHILD = """
import asyncio, importlib, sys
import numpy as np
module = importlib.import_module(sys.argv[1])
serve = getattr(module, sys.argv[2])
buf = np.empty(int(sys.argv[3]), dtype=np.uint8)
buf.fill(0)

async def sink(stream):
    header = bytearray(8)
    while True:
        try:
            await stream.receive_into(memoryview(header))
        except Exception:
            return
        await stream.receive_into(buf.data[: int.from_bytes(header, "little")])
        await stream.send([b"k"])

async def main():
    server = await serve(sink)
    print(server.address[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.aclose()

asyncio.run(main())
"""


def _import(module: str, name: str) -> Any:
    return getattr(__import__(module, fromlist=[name]), name)


async def _time_sends(
    client: ByteStream, receive: Callable[[int], Awaitable[None]], src: np.ndarray, repeats: int
) -> float:
    """Best GB/s over `repeats` sends of `src` (4 views) after one warm-up."""
    quarter = src.nbytes // 4
    views = [src.data[i * quarter : (i + 1) * quarter] for i in range(4)]
    best = 0.0
    for i in range(repeats + 1):
        start = time.perf_counter()
        await asyncio.gather(
            client.send([src.nbytes.to_bytes(8, "little"), *views]), receive(src.nbytes)
        )
        seconds = time.perf_counter() - start
        if i:
            best = max(best, src.nbytes / seconds / 1e9)
    return best


async def in_process(transport: str, src: np.ndarray, dst: np.ndarray, repeats: int) -> float:
    """Both ends in this event loop."""
    header = bytearray(8)

    async def run(client: ByteStream, server_side: ByteStream) -> float:
        async def receive(num_bytes: int) -> None:
            await server_side.receive_into(memoryview(header))
            await server_side.receive_into(dst.data[:num_bytes])

        return await _time_sends(client, receive, src, repeats)

    if transport == "memory":
        a, b = memory_stream_pair()
        try:
            return await run(a, b)
        finally:
            await a.aclose()
            await b.aclose()
    module, serve_name, open_name = SERVED[transport]
    accepted: asyncio.Queue[ByteStream] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(stream: ByteStream) -> None:
        await accepted.put(stream)
        await done.wait()

    server = await _import(module, serve_name)(handler)
    client = await _import(module, open_name)(server.address)
    try:
        return await run(client, await accepted.get())
    finally:
        done.set()
        await client.aclose()
        await server.aclose()


async def cross_process(transport: str, src: np.ndarray, repeats: int) -> float:
    """The receiver in a child process, acknowledging each send with one byte."""
    module, serve_name, open_name = SERVED[transport]
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CHILD,
        module,
        serve_name,
        str(src.nbytes),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        port = int(await child.stdout.readline())
        client = await _import(module, open_name)(("127.0.0.1", port))
        ack = bytearray(1)

        async def receive(num_bytes: int) -> None:
            await client.receive_into(memoryview(ack))

        try:
            return await _time_sends(client, receive, src, repeats)
        finally:
            await client.aclose()
    finally:
        child.stdin.close()
        await asyncio.wait_for(child.wait(), 30)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 64, 256])
    args = parser.parse_args()
    transports = ["memory", "tcp", "shm"] + (["nixl"] if nixl_available() else [])
    largest = max(args.sizes_mib) * MIB
    src = np.arange(largest // 4, dtype=np.uint32).view(np.uint8)
    dst = np.empty(largest, dtype=np.uint8)
    dst.fill(0)
    header = "transport".ljust(22) + "".join(f"{s:>10} MiB" for s in args.sizes_mib)
    print(f"GB/s, best of {args.repeats}; {os.cpu_count()} CPUs")
    print(header)
    for transport in transports:
        settings = [("same process", True)]
        if transport != "memory":
            settings.append(("two processes", False))
        for label, same in settings:
            cells = []
            for size in args.sizes_mib:
                view = src[: size * MIB]
                if same:
                    gbps = await in_process(transport, view, dst, args.repeats)
                else:
                    gbps = await cross_process(transport, view, args.repeats)
                cells.append(f"{gbps:>14.2f}")
            print(f"{transport} ({label})".ljust(22) + "".join(cells), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
