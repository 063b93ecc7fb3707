"""The receiving process of `pdserve bench transfer`: one engine's KV memory and its endpoints.

Started by the benchmark as `python -m pdlab.bench.transfer_peer FD` (a separate process, so
every figure crosses a process boundary as a prefill → decode handoff does), FD being its end
of a socketpair the benchmark keeps the other end of. It receives a `PeerSetup`, then:

- allocates a `KVCache` of the benchmark's layout and writes every byte of it once (the same
  pre-touch the sending side does), so no measured run pays first-touch page faults;
- serves each transport through `worker.kv_transports.serve` into a `KVReceiver` (sessions,
  Hello MAC under the cluster key, fencing), and a plain listening socket for the raw-socket
  baseline;
- answers commands one at a time: `Expect` (a reservation: lease on the blocks, the transfer
  registered, the lease epoch returned), `Take` (wait until verified, fence the writer, drop the
  lease, return the receiver's own Begin → Commit time), `RawOpen` / `RawReceive`
  (the baseline's connection, and its recv_into loop into the same KV memory), `HashTime` (xxh3 over the received bytes, cut as
  the receiver cuts them) and `Stop`.

Commands and replies are the frozen dataclasses below, over that private socketpair as a
`multiprocessing.connection.Connection` (two processes of this same build, nobody else).

It knows the transfer layer's receiving side and its own commands; not how results are judged.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import torch
import xxhash

from pdlab.bench.transfer_stats import LayoutSpec
from pdserve.auth.tls import TLSConfig, server_context
from pdserve.engine.kv_cache import KVCache
from pdserve.protocol.worker_api import Transport
from pdserve.transfer.byte_ranges import payload_views, split_payload
from pdserve.transfer.framing import PROGRESS_BYTES
from pdserve.transfer.messages import KVLayout
from pdserve.transfer.receiver import IncomingTransfer, KVReceiver
from pdserve.transfer.receiver_session import ReceivePlan
from pdserve.transfer.sender import LeaseHandle
from pdserve.transfer.session import FingerprintMap
from pdserve.transfer.tcp import TcpConfig, TcpServer, configure_socket
from pdserve.transfer.tls_stream import TlsServer, serve_tls
from pdserve.worker.kv import transports as kv_transports
from pdserve.worker.lease_keeper import LeaseKeeper


@dataclass(frozen=True, slots=True)
class PeerSetup:
    """The receiver's KV memory and what it serves."""

    layout: LayoutSpec
    num_blocks: int
    transports: tuple[Transport, ...]
    fingerprint: FingerprintMap
    cluster_key: bytes
    # (cert, key, CA) PEM paths when the "tls" target is measured.
    tls: tuple[str, str, str] | None = None


@dataclass(frozen=True, slots=True)
class PeerReady:
    """Where each transport listens (its control port on 127.0.0.1), and the raw socket's."""

    ports: dict[str, int]
    raw_port: int
    # transport → why it could not be served.
    unavailable: dict[str, str]


@dataclass(frozen=True, slots=True)
class Expect:
    """Reserve blocks 0..num_blocks-1 for one transfer (as a decode worker's /reserve does)."""

    transfer_id: bytes
    capability_token: bytes
    request_id: str
    num_blocks: int
    num_tokens: int
    token_digest: bytes
    lease_ttl_s: float


@dataclass(frozen=True, slots=True)
class Expected:
    """The reservation's lease epoch (the sender puts it in its Begin)."""

    epoch: int


@dataclass(frozen=True, slots=True)
class Take:
    """Wait for the transfer's verified commit, then hand it over (fence, drop the lease)."""

    transfer_id: bytes
    timeout_s: float


@dataclass(frozen=True, slots=True)
class Taken:
    """The receiver's own time from the accepted Begin to the verified Commit, and the CPU
    time this process spent from the reservation to the hand-over."""

    transport: str
    seconds: float
    cpu_seconds: float


@dataclass(frozen=True, slots=True)
class RawOpen:
    """Accept the raw-socket baseline's connection (kept for every later `RawReceive`)."""


@dataclass(frozen=True, slots=True)
class RawReceive:
    """Receive one payload of `num_bytes` on the raw connection into the KV memory, then
    acknowledge it with one byte on that connection."""

    num_bytes: int


@dataclass(frozen=True, slots=True)
class HashTime:
    """Time xxh3 over blocks 0..num_blocks-1, cut as the receiver cuts a transfer's data."""

    num_blocks: int
    frame_bytes: int
    num_runs: int


@dataclass(frozen=True, slots=True)
class Seconds:
    """One duration per run."""

    seconds: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class CpuSeconds:
    """The CPU time this process spent on a command."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Done:
    """A command without a result finished."""


@dataclass(frozen=True, slots=True)
class Failed:
    """A command failed; `reason` says why."""

    reason: str


@dataclass(frozen=True, slots=True)
class Stop:
    """Close every endpoint and exit."""


Command = Expect | Take | RawOpen | RawReceive | HashTime | Stop


def touch(view: memoryview, value: int) -> None:
    """Write every byte of `view` once (its pages are then resident and mapped)."""
    np.frombuffer(view, dtype=np.uint8).fill(value)


def new_kv_cache(layout: LayoutSpec, num_blocks: int, shared: bool = False) -> KVCache:
    """An engine's KV memory of `layout` with `num_blocks` blocks (zeroed); `shared`: in an
    exported arena, as a prefill worker that sends over shared memory keeps it."""
    return KVCache(
        num_blocks,
        layout.num_layers,
        layout.block_size,
        layout.num_kv_heads,
        layout.head_dim,
        layout.dtype,
        shared=shared,
    )


def wire_layout(layout: LayoutSpec, num_blocks: int) -> KVLayout:
    """The transfer protocol's description of `num_blocks` blocks of `layout`."""
    return KVLayout(
        layout.num_layers, num_blocks, layout.block_bytes, layout.dtype, layout.block_size
    )


def kv_bytes(kv: KVCache) -> memoryview:
    """Every byte of a KV cache as one flat writable view (blocks end to end, no copy)."""
    flat = kv.tensor.view(-1).view(torch.uint8).numpy()
    return memoryview(flat)  # type: ignore[arg-type]  # numpy exports the buffer protocol


def receiver_checksum(
    blocks: list[memoryview], block_bytes: int, payload_bytes: int, frame_bytes: int
) -> int:
    """xxh3 over a payload cut as `KVReceiver._land` cuts it: one digest per frame, fed in
    pieces of at most `PROGRESS_BYTES` of each block view. Returns the last frame's digest."""
    digest = 0
    for offset, num_bytes in split_payload(payload_bytes, frame_bytes):
        hasher = xxhash.xxh3_64()
        for view in payload_views(blocks, block_bytes, offset, num_bytes):
            for start in range(0, view.nbytes, PROGRESS_BYTES):
                hasher.update(view[start : start + PROGRESS_BYTES])
        digest = hasher.intdigest()
    return digest


@dataclass(slots=True)
class _Reservation:
    lease: LeaseHandle
    verified: asyncio.Event
    # time.process_time() when it was made.
    cpu_start: float


class _Peer:
    """The receiving engine's KV memory, its receiver and endpoints."""

    def __init__(self, setup: PeerSetup) -> None:
        self.setup = setup
        self.kv = new_kv_cache(setup.layout, setup.num_blocks)
        self.blocks = self.kv.block_views(list(range(setup.num_blocks)))
        for view in self.blocks:
            touch(view, 0)
        self.receiver = KVReceiver(setup.fingerprint, cluster_key=setup.cluster_key)
        self.leases = LeaseKeeper()
        self.reservations: dict[bytes, _Reservation] = {}
        self.servers: list[TcpServer | TlsServer] = []
        self.raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.raw.bind(("127.0.0.1", 0))
        self.raw.listen(1)
        self.raw_conn: socket.socket | None = None

    async def start(self) -> PeerReady:
        self.leases.start()
        ports: dict[str, int] = {}
        unavailable: dict[str, str] = {}
        for transport in self.setup.transports:
            handler = functools.partial(self.receiver.handle, transport=transport)
            try:
                server: TcpServer | TlsServer
                if transport == "tls":
                    assert self.setup.tls is not None
                    cert, key, ca = (Path(p) for p in self.setup.tls)
                    context = server_context(TLSConfig(cert, key, ca))
                    assert context is not None
                    server = await serve_tls(handler, "127.0.0.1", 0, context, max_connections=8)
                else:
                    server = await kv_transports.serve(
                        transport,
                        handler,
                        "127.0.0.1",
                        0,
                        handshake_timeout_s=self.receiver.limits.handshake_timeout_s,
                        max_connections=8,
                    )
            except Exception as exc:  # a transport that cannot serve here is reported
                unavailable[transport] = f"{type(exc).__name__}: {exc}"
                continue
            self.servers.append(server)
            ports[transport] = server.address[1]
        return PeerReady(ports, self.raw.getsockname()[1], unavailable)

    async def aclose(self) -> None:
        for server in self.servers:
            await server.aclose()
        for transfer_id in list(self.reservations):
            await self._end(transfer_id)
        await self.leases.aclose()
        if self.raw_conn is not None:
            self.raw_conn.close()
        self.raw.close()

    async def run(
        self, command: Command
    ) -> Expected | Taken | Seconds | CpuSeconds | Done | Failed:
        if isinstance(command, Expect):
            return self.expect(command)
        if isinstance(command, Take):
            return await self.take(command)
        if isinstance(command, RawOpen):
            return await asyncio.to_thread(self.raw_open)
        if isinstance(command, RawReceive):
            return await asyncio.to_thread(self.raw_receive, command)
        if isinstance(command, HashTime):
            return self.hash_time(command)
        return Failed(f"unknown command {type(command).__name__}")

    def expect(self, command: Expect) -> Expected | Failed:
        setup = self.setup
        block_ids = list(range(command.num_blocks))
        tid = command.transfer_id
        lease = self.leases.grant(
            block_ids,
            command.lease_ttl_s,
            f"reservation {command.request_id}",
            lambda: asyncio.get_running_loop().create_task(self._end(tid)),
        )
        layout = wire_layout(setup.layout, command.num_blocks)
        plan = ReceivePlan(
            tid,
            command.capability_token,
            layout,
            command.request_id,
            command.num_tokens,
            command.token_digest,
            epoch=lease.epoch,
        )
        verified = asyncio.Event()
        self.receiver.expect(
            IncomingTransfer(
                plan,
                self.blocks[: command.num_blocks],
                on_verified=verified.set,
                guard=lambda: self.leases.check(lease),
                on_progress=lease.heartbeat,
            )
        )
        self.reservations[tid] = _Reservation(lease, verified, time.process_time())
        return Expected(lease.epoch)

    async def take(self, command: Take) -> Taken | Failed:
        reservation = self.reservations.get(command.transfer_id)
        if reservation is None:
            return Failed(f"no reservation for transfer {command.transfer_id.hex()}")
        incoming = self.receiver.get(command.transfer_id)
        try:
            async with asyncio.timeout(command.timeout_s):
                await reservation.verified.wait()
        except TimeoutError:
            why = incoming.last_error if incoming is not None else "reservation ended"
            await self._end(command.transfer_id)
            return Failed(f"not verified within {command.timeout_s}s: {why}")
        assert incoming is not None
        seconds = 0.0
        if incoming.begin_ns is not None and incoming.verified_ns is not None:
            seconds = (incoming.verified_ns - incoming.begin_ns) / 1e9
        cpu_seconds = time.process_time() - reservation.cpu_start
        await self._end(command.transfer_id)
        return Taken(incoming.transport, seconds, cpu_seconds)

    async def _end(self, transfer_id: bytes) -> None:
        """Hand over or cancel: fence the writer first, then drop the lease (as KVInbox)."""
        await self.receiver.fence(transfer_id)
        reservation = self.reservations.pop(transfer_id, None)
        if reservation is not None:
            self.leases.drop(reservation.lease)

    def raw_open(self) -> Done:
        """Accept the baseline's connection, with the TCP transport's socket options."""
        self.raw.settimeout(30.0)
        conn, _ = self.raw.accept()
        configure_socket(conn, TcpConfig())
        conn.setblocking(True)
        if self.raw_conn is not None:
            self.raw_conn.close()
        self.raw_conn = conn
        return Done()

    def raw_receive(self, command: RawReceive) -> CpuSeconds | Failed:
        """The raw-socket baseline's receiving end: blocking recv_into, no framing."""
        cpu_start = time.process_time()
        conn = self.raw_conn
        if conn is None:
            return Failed("raw receive before RawOpen")
        target = kv_bytes(self.kv)[: command.num_bytes]
        if target.nbytes < command.num_bytes:
            return Failed(f"raw receive of {command.num_bytes} bytes: KV holds {target.nbytes}")
        received = 0
        while received < command.num_bytes:
            n = conn.recv_into(target[received:])
            if n == 0:
                return Failed(f"raw socket closed after {received} bytes")
            received += n
        conn.sendall(b"k")
        return CpuSeconds(time.process_time() - cpu_start)

    def hash_time(self, command: HashTime) -> Seconds:
        """The receiver's checksum work alone over the bytes a transfer of this size lands."""
        blocks = self.blocks[: command.num_blocks]
        payload = command.num_blocks * self.kv.block_bytes
        seconds = []
        for _ in range(command.num_runs):
            start = time.perf_counter()
            receiver_checksum(blocks, self.kv.block_bytes, payload, command.frame_bytes)
            seconds.append(time.perf_counter() - start)
        return Seconds(tuple(seconds))


async def _serve(conn: Connection) -> None:
    setup = await asyncio.to_thread(conn.recv)
    if not isinstance(setup, PeerSetup):
        raise SystemExit(f"transfer peer: expected a PeerSetup, got {type(setup).__name__}")
    peer = _Peer(setup)
    try:
        conn.send(await peer.start())
        while True:
            try:
                command = await asyncio.to_thread(conn.recv)
            except EOFError:
                return  # the benchmark went away
            if isinstance(command, Stop):
                return
            try:
                reply = await peer.run(command)
            except Exception as exc:  # reported to the benchmark, which names the command
                reply = Failed(f"{type(command).__name__}: {type(exc).__name__}: {exc}")
            conn.send(reply)
    finally:
        await peer.aclose()


def main(argv: list[str] | None = None) -> int:
    """Entry point: `python -m pdlab.bench.transfer_peer FD`, FD a connected socket
    inherited from the benchmark (one end of its socketpair)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m pdlab.bench.transfer_peer FD", file=sys.stderr)
        return 2
    with contextlib.closing(Connection(int(args[0]))) as conn:
        asyncio.run(_serve(conn))
    return 0


if __name__ == "__main__":
    # Run the importable module's `main`, not this `__main__` copy: the commands unpickle as
    # classes of `pdlab.bench.transfer_peer`, which must be the ones `_serve` checks against.
    from pdlab.bench import transfer_peer

    raise SystemExit(transfer_peer.main())
