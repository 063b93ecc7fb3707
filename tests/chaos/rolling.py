"""What the rolling-restart and rollout tests share: workers at fixed addresses, and a steady
load of streamed completions from a few client threads.

`FixedWorkers` starts two prefill and two decode workers at ports picked once, so a worker
stopped and started again comes back at its address (as a pod behind a stable name would).
`SteadyLoad` keeps `num_clients` threads sending requests until it is left, recording each
outcome (the streamed text pieces, or the exception) with the request's index.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from test_decode_death import stream_tokens
from worker_proc import WorkerHandle, launch_worker

Body = Callable[[int], dict[str, object]]


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out by itself (to port-0 binds and outgoing
    connections)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int) -> list[int]:
    """`count` loopback ports free now, below the kernel's ephemeral range. A worker restarted
    at its port then finds it free: with a port-0 pick, any test running beside it could be
    handed that port between the stop and the restart (seen once in `make test`: EADDRINUSE)."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randrange(10000, max(10001, low))
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    return ports


@dataclass
class FixedWorkers:
    """prefill-0/1 and decode-0/1 at fixed ports; every process started is in `handles`."""

    workdir: Path
    handles: list[WorkerHandle]
    # Extra flags by role (a drain timeout, a fault plan).
    extra: Callable[[str], Sequence[str]] = lambda role: ()
    specs: dict[str, tuple[str, tuple[str, ...]]] = field(init=False)

    def __post_init__(self) -> None:
        p = free_ports(6)
        self.specs = {
            "prefill-0": ("prefill", ("--port", str(p[0]))),
            "prefill-1": ("prefill", ("--port", str(p[1]))),
            "decode-0": ("decode", ("--port", str(p[2]), "--kv-port", str(p[3]))),
            "decode-1": ("decode", ("--port", str(p[4]), "--kv-port", str(p[5]))),
        }

    def start(self, name: str, model: Path) -> WorkerHandle:
        """Launch worker `name` (without waiting for it) with `model`."""
        role, args = self.specs[name]
        args = (*args, "--worker-id", name, *self.extra(role))
        handle = launch_worker(role, self.workdir, model=model, extra_args=args)
        self.handles.append(handle)
        return handle


@dataclass(frozen=True, slots=True)
class Timing:
    """One request as its client saw it: when it started (monotonic), TTFT and mean TPOT."""

    start_s: float
    ttft_s: float
    tpot_s: float


@dataclass
class SteadyLoad:
    """Client threads sending `body(i)` for i = k, k + n, k + 2n, ... until stopped."""

    url: str
    body: Body
    num_clients: int = 3
    outcomes: list[tuple[int, list[str] | BaseException]] = field(default_factory=list)
    # Timings of the requests that completed, in completion order.
    timings: list[Timing] = field(default_factory=list)

    def count(self) -> int:
        return len(self.outcomes)

    def _one(self, i: int) -> list[str]:
        start = time.monotonic()
        arrivals: list[float] = []
        pieces, _ = stream_tokens(
            self.url, self.body(i), on_chunk=lambda n: arrivals.append(time.monotonic())
        )
        if arrivals:
            tpot = (arrivals[-1] - arrivals[0]) / max(1, len(arrivals) - 1)
            self.timings.append(Timing(start, arrivals[0] - start, tpot))
        return pieces

    @contextmanager
    def running(self) -> Iterator[SteadyLoad]:
        """The load runs inside the block; leaving it stops the clients and waits for them."""
        stop = threading.Event()

        def client(k: int) -> None:
            i = k
            while not stop.is_set():
                try:
                    self.outcomes.append((i, self._one(i)))
                except Exception as exc:  # recorded: the test's assertion names it
                    self.outcomes.append((i, exc))
                i += self.num_clients

        threads = [threading.Thread(target=client, args=(k,)) for k in range(self.num_clients)]
        for t in threads:
            t.start()
        try:
            yield self
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=120)


def p99(values: Sequence[float]) -> float:
    """The 99th percentile (nearest rank); NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
