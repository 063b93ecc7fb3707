"""Processes for the membership tests: workers and routers that find each other through etcd.

`spawn` starts `python -m MODULE ARGS --ready-file F` (optionally inside a network namespace
through `wrap`, e.g. `ip netns exec NS`, which execs, so the PID is the Python process's) and
`wait_ready` waits for the file and a /health answer. Every handle stops by PID: `kill` is
SIGKILL (a crash), `stop` is SIGTERM then SIGKILL. `processes()` stops whatever the test
started. The HTTP helpers are plain urllib, as a client on another machine would be.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 90.0


@dataclass(slots=True)
class Proc:
    """One started worker or router."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    ready_file: Path
    url: str = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL by PID: the process dies without any clean-up (no lease revoke)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self) -> None:
        """SIGTERM by PID, without waiting."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM by PID, SIGKILL after `timeout_s`; returns the exit status."""
        self.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        return self.proc.returncode


# The admin key of the routers these helpers start (see `spawn`).
ADMIN_KEY = "admin-key-of-the-membership-tests"


def spawn(
    name: str, module: str, args: Sequence[str], workdir: Path, wrap: Sequence[str] = ()
) -> Proc:
    """Start `python -m module args` (inside `wrap`) without waiting."""
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / f"{name}.ready.json"
    log_path = workdir / f"{name}.log"
    # One intra-op thread per process: several share the test machine's cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if module == "pdserve.router.main":
        # Routers here listen on namespace addresses, not loopback: /debug needs the admin key.
        env["PDSERVE_ADMIN_KEY"] = ADMIN_KEY
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    command = [*wrap, sys.executable, "-m", module, *args, "--ready-file", str(ready)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    return Proc(name, proc, log_path, ready)


def wait_ready(handle: Proc, timeout_s: float = STARTUP_TIMEOUT_S) -> Proc:
    """Wait for the ready file and a /health answer; stop the process (by PID) on failure."""
    try:
        deadline = time.monotonic() + timeout_s
        while not handle.ready_file.exists():
            if handle.proc.poll() is not None:
                raise RuntimeError(
                    f"{handle.name} exited {handle.proc.returncode}:\n{handle.log()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{handle.name} not ready in {timeout_s}s:\n{handle.log()}")
            time.sleep(0.05)
        handle.url = str(json.loads(handle.ready_file.read_text())["url"])
        get_json(f"{handle.url}/health")
    except BaseException:
        handle.stop(timeout_s=2.0)
        raise
    return handle


def worker_args(role: str, host: str, discovery: str, ttl_s: int, model: Path) -> list[str]:
    """Flags of a worker that registers in `discovery`."""
    return ["--role", role, "--host", host, "--port", "0", "--kv-port", "0", "--model",
            str(model), "--discovery", discovery, "--membership-ttl-s", str(ttl_s)]  # fmt: skip


def router_args(host: str, discovery: str, model: Path) -> list[str]:
    """Flags of a router that finds its workers in `discovery`."""
    return ["--host", host, "--port", "0", "--model", str(model), "--discovery", discovery]


@contextlib.contextmanager
def processes() -> Iterator[list[Proc]]:
    """A list to append started processes to; all are stopped (in parallel) on exit."""
    handles: list[Proc] = []
    try:
        yield handles
    finally:
        for handle in handles:
            handle.terminate()
        for handle in handles:
            handle.stop()


def get_json(url: str, timeout_s: float = 10.0) -> dict[str, object]:
    """GET `url` as JSON (with the routers' admin key: /debug needs it off loopback)."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        data: dict[str, object] = json.loads(response.read())
        return data


def post_json(url: str, body: object, timeout_s: float = 60.0) -> tuple[int, dict[str, object]]:
    """POST `body`; (status, JSON answer), HTTP errors included. Connection errors raise."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def complete(router_url: str, max_tokens: int = 6) -> tuple[int, dict[str, object]]:
    """A greedy completion through the router."""
    body = {"model": "tiny-v2", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    return post_json(f"{router_url}/v1/completions", body)


def pool(router_url: str) -> dict[str, bool]:
    """The router's pool: member URL -> healthy."""
    workers = get_json(f"{router_url}/health")["workers"]
    assert isinstance(workers, list)
    return {str(w["url"]): bool(w["healthy"]) for w in workers}


def wait_until(
    what: str, check: Callable[[], bool], timeout_s: float, step_s: float = 0.05
) -> float:
    """Poll `check` until true; returns the seconds it took, fails naming `what` otherwise."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(step_s)
    return time.monotonic() - start
