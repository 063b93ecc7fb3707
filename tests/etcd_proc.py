"""A real etcd server for membership tests: `start_etcd`, `etcd_server` (a module fixture).

`etcd` (Debian's `etcd-server`, 3.4) runs as a single-member cluster with a temporary data dir,
on free loopback ports (or on a given host inside a network namespace), until `stop` ends it by
PID: SIGTERM, a short wait, then SIGKILL. Tests skip with the reason when the binary is absent;
`make test` installs it first, so CI runs them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

STARTUP_TIMEOUT_S = 20.0
MISSING = "etcd is not on PATH (Debian: apt-get install etcd-server; `make test` installs it)"


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class EtcdHandle:
    """One running etcd."""

    host: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def uri(self, prefix: str = "/pdserve") -> str:
        """The `--discovery` value for this server and `prefix`."""
        return f"etcd://{self.host}:{self.port}{prefix}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill_for_test(self) -> None:
        """SIGKILL by PID and reap: etcd crashes, its data dir stays for a restart."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(10.0)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM by PID, SIGKILL if it has not exited after `timeout_s`."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(timeout_s)


def start_etcd(
    workdir: Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    peer_port: int | None = None,
    wrap: Sequence[str] = (),
) -> EtcdHandle:
    """Start etcd and wait until /health says true; `wrap` prefixes the command line (e.g.
    `ip netns exec NS`, with `host` an address of that namespace this process can reach)."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip(MISSING)
    port = port or free_port()
    peer_port = peer_port or free_port()
    data = workdir / f"etcd-{port}"
    data.mkdir(parents=True, exist_ok=True)
    client_url, peer_url = f"http://{host}:{port}", f"http://{host}:{peer_port}"
    args = [*wrap, binary, "--name", "pdtest", "--data-dir", str(data)]
    args += ["--listen-client-urls", client_url, "--advertise-client-urls", client_url]
    args += ["--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url]
    args += ["--initial-cluster", f"pdtest={peer_url}", "--logger", "zap", "--log-level", "warn"]
    log_path = workdir / f"etcd-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    handle = EtcdHandle(host, port, proc, log_path)
    try:
        _wait_healthy(handle)
    except BaseException:
        handle.stop(timeout_s=2.0)
        raise
    return handle


def _healthy(handle: EtcdHandle) -> bool:
    url = f"http://{handle.host}:{handle.port}/health"
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(json.loads(response.read()).get("health") == "true")
    except OSError:
        return False


def _wait_healthy(handle: EtcdHandle) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not _healthy(handle):
        if handle.proc.poll() is not None:
            raise RuntimeError(f"etcd exited {handle.proc.returncode}:\n{handle.log()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"etcd not healthy in {STARTUP_TIMEOUT_S}s:\n{handle.log()}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdHandle]:
    """One etcd on loopback for the whole module, stopped by PID at the end."""
    handle = start_etcd(tmp_path_factory.mktemp("etcd"))
    try:
        yield handle
    finally:
        handle.stop()
