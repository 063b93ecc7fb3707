"""`pdserve bench transfer`, part `kv`: KV handoffs between two processes against memcpy and a
raw socket.

Per size (default 1, 16, 128 MiB and 1 GiB of KV in the engine's paged layout):
1. baselines: memcpy (one copy of the KV memory into a pre-touched buffer in this process) and
   a raw socket (plain blocking `sendall` / `recv_into` over loopback from this process's KV
   memory into the peer process's, on one kept connection with the TCP transport's socket
   options);
2. a full KV handoff for each transport (tcp, shm, nixl; nixl only where it imports) from this
   process's `KVCache` into the peer's (`transfer_peer`, a separate process): the worker's
   transports (`worker.kv_transports`), a pooled connection (`ConnectionPool`, as a prefill
   worker keeps one), `send_with_retries` with a lease on the sent blocks, the peer's
   `KVReceiver` with a reservation lease and its epoch, Hello MACs under a cluster key,
   checksums on, the writer fenced at the hand-over;
3. xxh3 alone over the same bytes on each side, cut as that side cuts them.

Runs are rounds: each round runs every measurement of the size once, in an order rotated per
round (so background load that drifts, and cache state, favour none), and the first
`num_warmup` rounds are not counted; each figure is the median of `num_runs` rounds. Both
processes write every byte of their KV memory before anything is timed, the pooled
connections and the raw socket's connection are opened by the warm-up, and the baselines move
the same bytes between the same buffers as the handoffs, so no side is warmer than another.
Each process's CPU time per handoff is recorded too: on a machine whose cores are shared, it
says what the transport costs apart from waiting for a core. The arithmetic and the table are
`transfer_stats`; the command is `transfer_command`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TypeVar, cast

import numpy as np

from pdlab.bench.transfer_peer import (
    CpuSeconds,
    Done,
    Expect,
    Expected,
    Failed,
    HashTime,
    PeerReady,
    PeerSetup,
    RawOpen,
    RawReceive,
    Seconds,
    Stop,
    Take,
    Taken,
    kv_bytes,
    new_kv_cache,
    touch,
    wire_layout,
)
from pdlab.bench.transfer_stats import (
    MIB,
    TARGETS,
    CpuRuns,
    HandoffCell,
    LayoutSpec,
    Samples,
    TransferReport,
)
from pdlab.tls_certs import make_cert_set
from pdserve.advise.flags import at_least, checked, integers, one_integer
from pdserve.auth.tls import TLSConfig, client_context
from pdserve.errors import ConfigError, PdserveError
from pdserve.protocol.worker_api import Transport
from pdserve.transfer.byte_ranges import DEFAULT_FRAME_BYTES, payload_views, split_payload
from pdserve.transfer.codec import MAX_DATA_BYTES, data_checksum
from pdserve.transfer.messages import token_digest
from pdserve.transfer.nixl_transport import nixl_available
from pdserve.transfer.sender import OutgoingTransfer, SendPolicy, send_with_retries
from pdserve.transfer.sender_session import SenderSession
from pdserve.transfer.stream import Address, ByteStream
from pdserve.transfer.tcp import TcpConfig, configure_socket
from pdserve.transfer.tls_stream import open_tls_stream
from pdserve.worker.kv import transports as kv_transports
from pdserve.worker.kv.connections import ConnectionPool
from pdserve.worker.lease_keeper import LeaseKeeper

# 1 MiB per block (`LayoutSpec`'s default), so every default size is whole blocks.
DEFAULT_LAYOUT = LayoutSpec()
DEFAULT_SIZES = (1 * MIB, 16 * MIB, 128 * MIB, 1024 * MIB)
LEASE_TTL_S = 30.0
PEER_TIMEOUT_S = 120.0

R = TypeVar("R")


class BenchError(PdserveError):
    """The benchmark could not measure what it was asked to (a peer or a handoff failed)."""


def _transports(flag: str, text: str) -> tuple[str, ...]:
    transports = tuple(t.strip() for t in text.split(","))
    if any(t not in TARGETS for t in transports) or len(set(transports)) != len(transports):
        raise ConfigError(f"{flag}: expected distinct names from {','.join(TARGETS)}, got {text!r}")
    return transports


def _frame_bytes(flag: str, text: str) -> int:
    frame_kib = one_integer(flag, text, 1)
    if frame_kib * 1024 > MAX_DATA_BYTES:
        raise ConfigError(f"{flag}: at most {MAX_DATA_BYTES // 1024}, got {frame_kib}")
    return frame_kib * 1024


@dataclass(frozen=True, slots=True)
class TransferBenchConfig:
    """What one `pdserve bench transfer` measures."""

    sizes: tuple[int, ...] = checked(
        DEFAULT_SIZES,
        lambda flag, text: tuple(k * 1024 for k in sorted(set(integers(flag, text, 1)))),
        name="sizes-kib",
        to_flag=lambda sizes: ",".join(str(n // 1024) for n in sizes),
        help="KV sizes per handoff in KiB, comma-separated (whole blocks)",
    )
    transports: tuple[str, ...] = checked(
        ("tcp", "shm", "nixl"), _transports, help="comma-separated, from tcp,shm,nixl,tls"
    )
    num_runs: int = checked(5, at_least(1), name="runs", help="timed runs per cell (median counts)")
    num_warmup: int = checked(1, at_least(0), name="warmup", help="untimed runs before them")
    layout: LayoutSpec = DEFAULT_LAYOUT
    frame_bytes: int = checked(
        DEFAULT_FRAME_BYTES,
        _frame_bytes,
        name="frame-kib",
        to_flag=lambda num_bytes: str(num_bytes // 1024),
        help="KV data per Chunk frame (KiB)",
    )

    def __post_init__(self) -> None:
        if not self.sizes or self.num_runs < 1 or self.num_warmup < 0:
            raise ConfigError(
                f"--runs / --warmup / --sizes-kib: need sizes, runs >= 1 and warm-up >= 0, got"
                f" {self.num_runs} runs, {self.num_warmup} warm-up, sizes {self.sizes}"
            )
        for size in self.sizes:
            try:
                self.layout.num_blocks(size)
            except ValueError as exc:
                raise ConfigError(f"--sizes-kib: {exc}") from None
        unknown = [t for t in self.transports if t not in TARGETS]
        if unknown or not self.transports:
            raise ConfigError(f"--transports: expected names from tcp,shm,nixl,tls, got {unknown}")
        if not 1 <= self.frame_bytes <= MAX_DATA_BYTES:
            raise ConfigError(
                f"--frame-kib: must be 1..{MAX_DATA_BYTES // 1024} KiB, got {self.frame_bytes} bytes"
            )

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks(max(self.sizes))


class _PeerProcess:
    """The receiving process, started by PID and stopped by PID."""

    def __init__(self, setup: PeerSetup, workdir: Path) -> None:
        ours, theirs = socket.socketpair()
        self.log_path = workdir / "transfer-peer.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pdlab.bench.transfer_peer", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(setup)

    async def ready(self) -> PeerReady:
        return await self.reply(PeerReady)

    def send(self, command: object) -> None:
        self.conn.send(command)

    async def reply(self, kind: type[R], timeout_s: float = PEER_TIMEOUT_S) -> R:
        """The peer's next reply, which must be a `kind`; BenchError otherwise."""
        if not await asyncio.to_thread(self.conn.poll, timeout_s):
            raise BenchError(f"transfer peer (pid {self.proc.pid}) silent for {timeout_s}s")
        try:
            reply = self.conn.recv()
        except (EOFError, OSError):
            raise BenchError(
                f"transfer peer (pid {self.proc.pid}) went away; its log ends:\n" + self.log_tail()
            ) from None
        if isinstance(reply, Failed):
            raise BenchError(f"transfer peer: {reply.reason}")
        if not isinstance(reply, kind):
            raise BenchError(f"transfer peer: expected {kind.__name__}, got {reply!r}")
        return reply

    def log_tail(self, num_lines: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-num_lines:])

    async def call(self, command: object, kind: type[R]) -> R:
        self.send(command)
        return await self.reply(kind)

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(Stop())
        self.conn.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass(frozen=True, slots=True)
class _Handoff:
    """What one handoff took."""

    sent_s: float
    received_s: float
    num_retries: int
    # CPU time of each process (the receiver's from its reservation to the hand-over).
    sender_cpu_s: float
    receiver_cpu_s: float


class _Sender:
    """This process's KV memory and the prefill side of each handoff."""

    def __init__(self, config: TransferBenchConfig, fingerprint: dict[str, str], key: bytes):
        spec = config.layout
        self.config = config
        # The sending engine's KV as a prefill worker keeps it (`EngineConfig.shared_kv`).
        self.kv = new_kv_cache(spec, config.num_blocks, shared=True)
        if self.kv.block_bytes != spec.block_bytes:
            raise BenchError(f"KV cache blocks of {self.kv.block_bytes} bytes, layout says {spec}")
        self.blocks = self.kv.block_views(list(range(config.num_blocks)))
        # Random bytes (the same block everywhere, numbered): every page written once.
        pattern = np.random.default_rng(0).integers(0, 256, self.kv.block_bytes, dtype=np.uint8)
        for i, view in enumerate(self.blocks):
            np.frombuffer(view, dtype=np.uint8)[:] = pattern
            view[:8] = i.to_bytes(8, "little")
        # memcpy's destination, as warm as the peer's KV memory.
        self.scratch = memoryview(bytearray(config.num_blocks * self.kv.block_bytes))
        touch(self.scratch, 0)
        self.fingerprint = fingerprint
        self.key = key
        self.leases = LeaseKeeper()
        self.pool = ConnectionPool(self._connect)
        # Set by `measure` when TLS is measured: how the "tls" target dials.
        self.tls_client: ssl.SSLContext | None = None
        self.policy = SendPolicy(frame_bytes=config.frame_bytes)
        self.num_handoffs = 0
        self.raw: socket.socket | None = None

    async def _connect(self, transport: Transport, address: Address) -> ByteStream:
        # "tls" is TCP in mutual TLS, as a worker with --tls-* dials its KV peers.
        if transport == "tls":
            assert self.tls_client is not None
            return await open_tls_stream(address, self.tls_client)
        return await kv_transports.connect(transport, address)

    def memcpy(self, num_bytes: int) -> tuple[float, float]:
        """One copy of `num_bytes` of KV memory into a pre-touched buffer: (seconds, CPU
        seconds)."""
        src = kv_bytes(self.kv)[:num_bytes]
        dst = self.scratch[:num_bytes]
        cpu_start = time.process_time()
        start = time.perf_counter()
        dst[:] = src
        return time.perf_counter() - start, time.process_time() - cpu_start

    async def open_raw(self, peer: _PeerProcess, ready: PeerReady) -> None:
        """The raw-socket baseline's connection, kept for every run (as the pool keeps the
        transports' connections), with the socket options of the TCP transport."""
        peer.send(RawOpen())
        sock = socket.create_connection(("127.0.0.1", ready.raw_port), timeout=30)
        configure_socket(sock, TcpConfig())
        sock.setblocking(True)
        self.raw = sock
        await peer.reply(Done)

    async def raw_socket(self, peer: _PeerProcess, num_bytes: int) -> tuple[float, float, float]:
        """One plain sendall of `num_bytes` of KV memory to the peer, until its ack: (seconds,
        sender CPU seconds, receiver CPU seconds)."""
        assert self.raw is not None
        sock = self.raw
        peer.send(RawReceive(num_bytes))
        src = kv_bytes(self.kv)[:num_bytes]
        ack = bytearray(1)

        def one() -> tuple[float, float]:
            cpu_start = time.process_time()
            start = time.perf_counter()
            sock.sendall(src)
            if sock.recv_into(ack) != 1:
                raise BenchError("raw socket: the peer closed before its ack")
            return time.perf_counter() - start, time.process_time() - cpu_start

        seconds, cpu_seconds = await asyncio.to_thread(one)
        received = await peer.reply(CpuSeconds)
        return seconds, cpu_seconds, received.seconds

    async def handoff(
        self, peer: _PeerProcess, transport: str, port: int, num_bytes: int
    ) -> _Handoff:
        """One handoff of `num_bytes` from this process's KV into the peer's."""
        spec = self.config.layout
        num_blocks = spec.num_blocks(num_bytes)
        num_tokens = num_blocks * spec.block_size
        digest = token_digest(range(num_tokens))
        self.num_handoffs += 1
        rid = f"bench-{self.num_handoffs}"
        tid, token = os.urandom(16), os.urandom(16)
        expected = await peer.call(
            Expect(tid, token, rid, num_blocks, num_tokens, digest, LEASE_TTL_S), Expected
        )
        task = asyncio.current_task()
        assert task is not None
        lease = self.leases.grant(
            list(range(num_blocks)), LEASE_TTL_S, f"prefill {rid}", task.cancel
        )
        layout = wire_layout(spec, num_blocks)
        transfer = OutgoingTransfer(
            tid,
            rid,
            1,
            layout,
            num_tokens,
            digest,
            token,
            self.blocks[:num_blocks],
            epoch=expected.epoch,
        )
        session = SenderSession(tid, self.fingerprint, cluster_key=self.key)
        address = ("127.0.0.1", port)
        kind = cast(Transport, transport)  # one of TARGETS: checked by TransferConfig

        async def connect() -> ByteStream:
            return await self.pool.acquire(kind, address)

        async def release(stream: ByteStream, ok: bool) -> None:
            await self.pool.release(kind, address, stream, ok)

        try:
            cpu_start = time.process_time()
            start = time.perf_counter()
            report = await send_with_retries(
                connect,
                session,
                transfer,
                self.policy,
                deadline=self.leases.clock.now() + LEASE_TTL_S,
                lease=lease,
                clock=self.leases.clock,
                release=release,
            )
            seconds = time.perf_counter() - start
            cpu_seconds = time.process_time() - cpu_start
        finally:
            self.leases.drop(lease)
        taken = await peer.call(Take(tid, LEASE_TTL_S), Taken)
        if taken.transport != transport:
            raise BenchError(f"{transport} handoff arrived over {taken.transport!r}")
        return _Handoff(seconds, taken.seconds, report.attempts - 1, cpu_seconds, taken.cpu_seconds)

    def checksum(self, num_bytes: int) -> float:
        """The sender's checksum work alone, as `send_attempt` does it (`data_checksum` per
        frame over views of the blocks): seconds."""
        block_bytes = self.kv.block_bytes
        blocks = self.blocks[: num_bytes // block_bytes]
        start = time.perf_counter()
        for offset, n in split_payload(num_bytes, self.config.frame_bytes):
            data_checksum(payload_views(blocks, block_bytes, offset, n))
        return time.perf_counter() - start

    async def aclose(self) -> None:
        if self.raw is not None:
            self.raw.close()
        await self.pool.aclose()
        await self.leases.aclose()


@dataclass(slots=True)
class _Runs:
    """Seconds collected per measurement of one size, timed runs only."""

    memcpy: list[tuple[float, float]] = field(default_factory=list)
    raw_socket: list[tuple[float, float, float]] = field(default_factory=list)
    handoffs: dict[str, list[_Handoff]] = field(default_factory=dict)
    sender_checksum: list[float] = field(default_factory=list)
    receiver_checksum: list[float] = field(default_factory=list)


async def _round(
    sender: _Sender,
    peer: _PeerProcess,
    ready: PeerReady,
    transports: list[str],
    num_bytes: int,
    order: int,
    runs: _Runs,
    failed: dict[str, str],
) -> None:
    """One run of every measurement of a size, in an order rotated by `order` (so that
    drifting background load and cache state favour none of them)."""
    names = ["memcpy", "raw_socket", *(t for t in transports if t not in failed)]
    shift = order % len(names)
    for name in names[shift:] + names[:shift]:
        if name == "memcpy":
            runs.memcpy.append(sender.memcpy(num_bytes))
        elif name == "raw_socket":
            runs.raw_socket.append(await sender.raw_socket(peer, num_bytes))
        else:
            try:
                handoff = await sender.handoff(peer, name, ready.ports[name], num_bytes)
            except (PdserveError, OSError) as exc:
                failed[name] = f"failed at {num_bytes} bytes: {type(exc).__name__}: {exc}"
                continue
            runs.handoffs.setdefault(name, []).append(handoff)
    # The checksum's own time on each side, over the bytes just moved, cut as each side cuts.
    num_blocks = sender.config.layout.num_blocks(num_bytes)
    hashed = await peer.call(HashTime(num_blocks, sender.config.frame_bytes, 1), Seconds)
    runs.receiver_checksum.extend(hashed.seconds)
    runs.sender_checksum.append(sender.checksum(num_bytes))


def _cells(
    runs: _Runs, num_bytes: int, report: TransferReport, transports: list[str]
) -> list[HandoffCell]:
    """The handoff cells of one size from its collected runs."""
    cells = []
    for name in transports:
        handoffs = runs.handoffs.get(name)
        if not handoffs:
            continue
        cells.append(
            HandoffCell(
                name,
                Samples(num_bytes, tuple(h.sent_s for h in handoffs)),
                Samples(num_bytes, tuple(h.received_s for h in handoffs)),
                Samples(num_bytes, tuple(runs.sender_checksum)),
                Samples(num_bytes, tuple(runs.receiver_checksum)),
                report.baseline(TARGETS[name][0], num_bytes),
                sum(h.num_retries for h in handoffs),
                CpuRuns(
                    tuple(h.sender_cpu_s for h in handoffs),
                    tuple(h.receiver_cpu_s for h in handoffs),
                ),
                report.baseline_cpu(TARGETS[name][0], num_bytes),
            )
        )
    return cells


async def measure(config: TransferBenchConfig, workdir: Path) -> TransferReport:
    """Run every baseline and handoff of `config`; transports that fail are reported."""
    spec = config.layout
    report = TransferReport(
        spec, config.frame_bytes, config.num_runs, config.num_warmup, config.sizes
    )
    transports = list(config.transports)
    if "nixl" in transports and not nixl_available():
        transports.remove("nixl")
        report.unavailable["nixl"] = (
            "the nixl package does not import here (pip install --no-deps nixl==1.5.1"
            " nixl-cu12==1.5.1)"
        )
    fingerprint = {
        "bench": "transfer",
        "layout": f"{spec.num_layers}x{spec.num_kv_heads}x{spec.head_dim}/{spec.block_size}",
        "dtype": spec.dtype,
    }
    key = os.urandom(32)
    certs = make_cert_set(workdir / "tls", "bench") if "tls" in transports else None
    setup = PeerSetup(
        spec,
        config.num_blocks,
        tuple(transports),  # type: ignore[arg-type]
        fingerprint,
        key,
        None if certs is None else (str(certs.cert), str(certs.key), str(certs.ca)),
    )
    peer = _PeerProcess(setup, workdir)
    sender: _Sender | None = None
    try:
        sender = _Sender(config, fingerprint, key)
        if certs is not None:
            sender.tls_client = client_context(TLSConfig(certs.cert, certs.key, certs.ca))
        ready = await peer.ready()
        report.unavailable.update(ready.unavailable)
        transports = [t for t in transports if t in ready.ports]
        await sender.open_raw(peer, ready)
        failed: dict[str, str] = {}
        for num_bytes in config.sizes:
            runs = _Runs()
            for i in range(config.num_warmup + config.num_runs):
                timed = _Runs() if i < config.num_warmup else runs
                await _round(sender, peer, ready, transports, num_bytes, i, timed, failed)
            report.memcpy[num_bytes] = Samples(num_bytes, tuple(r[0] for r in runs.memcpy))
            report.memcpy_cpu[num_bytes] = CpuRuns(tuple(r[1] for r in runs.memcpy))
            report.raw_socket[num_bytes] = Samples(num_bytes, tuple(r[0] for r in runs.raw_socket))
            report.raw_socket_cpu[num_bytes] = CpuRuns(
                tuple(r[1] for r in runs.raw_socket), tuple(r[2] for r in runs.raw_socket)
            )
            ok = [t for t in transports if t not in failed]
            report.cells.extend(_cells(runs, num_bytes, report, ok))
        report.failed.update(failed)
    finally:
        if sender is not None:
            await sender.aclose()
        peer.stop()
    return report
