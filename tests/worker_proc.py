"""Start real worker processes for integration tests (and the router's): `start_worker`.

Each worker is `python -m pdserve.worker.main ... --port 0 --kv-port 0 --ready-file F`; the
helper waits for the ready file (the real URL) and then for /health, and `stop` ends it by PID:
SIGTERM, a short wait, then SIGKILL. `worker_processes` is a context manager that stops every
worker it started, whatever the test did; `worker_factory` is the same as a pytest fixture.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

STARTUP_TIMEOUT_S = 60.0


@dataclass(slots=True)
class WorkerHandle:
    """One running worker process."""

    url: str
    pid: int
    proc: subprocess.Popen[bytes]
    role: str
    log_path: Path
    ready_file: Path
    health: dict[str, object] = field(default_factory=dict)
    terminated: bool = False

    def terminate(self) -> None:
        """Send SIGTERM by PID (a graceful stop) once, without waiting."""
        if self.proc.poll() is None and not self.terminated:
            self.terminated = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM by PID, then SIGKILL after `timeout_s`; returns the exit status."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(timeout_s)
        return self.proc.returncode

    def log(self) -> str:
        """What the worker wrote to stdout/stderr so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def _get_json(
    url: str, timeout_s: float, context: ssl.SSLContext | None = None
) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=timeout_s, context=context) as response:
        data: dict[str, object] = json.loads(response.read())
        return data


def launch_worker(
    role: str,
    workdir: Path,
    *,
    model: Path | str | None = None,
    extra_args: Sequence[str] = (),
) -> WorkerHandle:
    """Spawn a worker without waiting (start several, then `wait_ready` each)."""
    workdir.mkdir(parents=True, exist_ok=True)
    name = f"{role}-{time.monotonic_ns()}"
    ready = workdir / f"{name}.ready.json"
    log_path = workdir / f"{name}.log"
    args = [sys.executable, "-m", "pdserve.worker.main", "--role", role, "--host", "127.0.0.1"]
    args += ["--port", "0", "--kv-port", "0", "--ready-file", str(ready)]
    # Stopped at once by default (a test's teardown stops workers that may still hold a
    # paused peer's lease); the drain tests give their own --drain-timeout-s.
    args += ["--drain-timeout-s", "0"]
    args += ["--model", str(model)] if model is not None else []
    args += list(extra_args)
    # One intra-op thread per worker: several workers share the test machine's cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    return WorkerHandle("", proc.pid, proc, role, log_path, ready)


def wait_ready(
    handle: WorkerHandle,
    timeout_s: float = STARTUP_TIMEOUT_S,
    context: ssl.SSLContext | None = None,
) -> WorkerHandle:
    """Wait for the ready file and a /health answer (over TLS with `context`); stop the worker
    (by PID) on failure."""
    try:
        deadline = time.monotonic() + timeout_s
        while not handle.ready_file.exists():
            if handle.proc.poll() is not None:
                raise RuntimeError(
                    f"worker {handle.role} exited {handle.proc.returncode}:\n{handle.log()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"worker {handle.role} not ready in {timeout_s}s:\n{handle.log()}"
                )
            time.sleep(0.05)
        handle.url = str(json.loads(handle.ready_file.read_text())["url"])
        handle.health = _get_json(f"{handle.url}/health", timeout_s=10.0, context=context)
    except BaseException:
        handle.stop(timeout_s=2.0)
        raise
    return handle


def start_worker(
    role: str,
    workdir: Path,
    *,
    model: Path | str | None = None,
    extra_args: Sequence[str] = (),
    timeout_s: float = STARTUP_TIMEOUT_S,
) -> WorkerHandle:
    """Launch a worker and wait until it answers /health; kill it by PID if it does not."""
    handle = launch_worker(role, workdir, model=model, extra_args=extra_args)
    return wait_ready(handle, timeout_s)


@contextlib.contextmanager
def worker_processes() -> Iterator[list[WorkerHandle]]:
    """A list to append started workers to; every one is stopped on exit."""
    handles: list[WorkerHandle] = []
    try:
        yield handles
    finally:
        for handle in handles:  # all at once: they stop in parallel
            handle.terminate()
        for handle in handles:
            handle.stop()


@pytest.fixture
def worker_factory(tmp_path: Path) -> Iterator[Callable[..., WorkerHandle]]:
    """`worker_factory(role, model=..., extra_args=...)` starts a worker; all stop at teardown.

    Import it into a test module (`from worker_proc import worker_factory`) to use it.
    """
    with worker_processes() as handles:

        def start(role: str, **kwargs: Any) -> WorkerHandle:
            handle = start_worker(role, tmp_path / "workers", **kwargs)
            handles.append(handle)
            return handle

        yield start


@contextlib.contextmanager
def router_process(
    workdir: Path,
    model: Path | str,
    worker_urls: Sequence[str],
    mode: str = "disagg",
    extra_args: Sequence[str] = (),
) -> Iterator[str]:
    """`python -m pdserve.router.main` over `worker_urls`; yields its URL, then SIGTERM by PID
    (which must exit 0), SIGKILL if it does not stop."""
    ready = workdir / "router.ready.json"
    args = [sys.executable, "-m", "pdserve.router.main", "--model", str(model)]
    args += ["--ready-file", str(ready), "--mode", mode]
    for url in worker_urls:
        args += ["--worker", url]
    args += list(extra_args)
    with (workdir / "router.log").open("wb") as log:
        router = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert router.poll() is None, (workdir / "router.log").read_text()
            assert time.monotonic() < deadline, "router not ready in 30 s"
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        assert info["pid"] == router.pid
        yield str(info["url"])
        os.kill(router.pid, signal.SIGTERM)
        assert router.wait(10) == 0
    finally:
        if router.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(router.pid, signal.SIGKILL)
            router.wait(5)
