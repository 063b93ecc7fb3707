"""The supervisor against real processes (a tiny HTTP server as the child): a killed child
comes back at the same address, a crash loop is given up with its reason, a SIGSTOPped child
is killed by the liveness deadline and restarted, a child whose fingerprint changed is not let
back, a child that never starts is a launch error. Every process is stopped by PID."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.supervise.etcd import free_port
from pdserve.supervise.policy import RestartPolicy
from pdserve.supervise.process import LaunchError, pid_alive
from pdserve.supervise.supervisor import ChildKind, ChildSpec, ChildState, Supervisor

CHILD = """
import http.server, json, os, sys, threading
port, fingerprint_file, die_after = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        digest = open(fingerprint_file).read().strip()
        body = json.dumps({"fingerprint_digest": digest, "pid": os.getpid()}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
if die_after > 0:
    threading.Timer(die_after, lambda: os._exit(3)).start()
server.serve_forever()
"""
FAST = RestartPolicy(initial_backoff_s=0.1, max_backoff_s=0.2, max_restarts=2, window_s=30.0)


def spec(tmp_path: Path, die_after: float = 0.0, name: str = "w") -> ChildSpec:
    port = free_port()
    fingerprint = tmp_path / f"{name}.fp"
    if not fingerprint.exists():
        fingerprint.write_text("digest-a")
    argv = (sys.executable, "-c", CHILD, str(port), str(fingerprint), str(die_after))
    url = f"http://127.0.0.1:{port}"
    return ChildSpec(name, ChildKind.WORKER, argv, command=True, health_url=url)


@pytest.fixture
def messages() -> list[str]:
    return []


@pytest.fixture
def make(tmp_path: Path, messages: list[str]) -> Iterator[object]:
    made: list[Supervisor] = []

    def build(**kwargs: object) -> Supervisor:
        sup = Supervisor(tmp_path, notify=messages.append, probe_interval_s=0.2, **kwargs)  # type: ignore[arg-type]
        made.append(sup)
        return sup

    yield build
    for sup in made:
        pids = sup.all_pids()
        sup.stop(grace_s=3.0)
        assert not any(pid_alive(p) for p in pids)


def step_until(sup: Supervisor, done: object, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        sup.step(time.monotonic())
        time.sleep(0.05)


def health(url: str) -> dict[str, object]:
    with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
        data: dict[str, object] = json.loads(resp.read())
        return data


def test_a_killed_child_is_restarted_at_the_same_address(
    tmp_path: Path, make: object, messages: list[str]
) -> None:
    sup: Supervisor = make(policy=FAST)  # type: ignore[operator]
    child = spec(tmp_path)
    sup.start(child)
    sup.wait_ready(["w"], time.monotonic() + 15)
    first = sup.pid("w")
    assert first is not None and health(child.health_url or "")["pid"] == first
    os.kill(first, signal.SIGKILL)
    step_until(
        sup, lambda: sup.state("w") is ChildState.RUNNING and sup.pid("w") not in (None, first)
    )
    assert health(child.health_url or "")["pid"] == sup.pid("w")
    (status,) = sup.statuses()
    assert (status.num_restarts, status.last_exit, status.state) == (
        1,
        "killed by signal 9",
        "running",
    )
    assert any("killed by signal 9; restarting in 0.1 s" in m for m in messages)


def test_a_crash_loop_is_given_up_with_its_reason(
    tmp_path: Path, make: object, messages: list[str]
) -> None:
    sup: Supervisor = make(policy=FAST)  # type: ignore[operator]
    sup.start(spec(tmp_path, die_after=0.6))
    sup.wait_ready(["w"], time.monotonic() + 15)
    step_until(sup, lambda: sup.state("w") is ChildState.GIVEN_UP)
    (status,) = sup.statuses()
    assert status.num_restarts == 2 and status.pid is None
    assert status.reason is not None and status.reason.startswith(
        "exited 3 times within 30 s (last: exit code 3): a crash loop, not restarted; see "
    )
    assert messages[-1] == f"w: {status.reason}"
    assert not any(pid_alive(p) for p in sup.all_pids())


def test_a_stopped_child_is_killed_by_the_liveness_deadline_and_restarted(
    tmp_path: Path, make: object, messages: list[str]
) -> None:
    sup: Supervisor = make(policy=FAST, liveness_timeout_s=1.0)  # type: ignore[operator]
    sup.start(spec(tmp_path))
    sup.wait_ready(["w"], time.monotonic() + 15)
    first = sup.pid("w")
    assert first is not None
    os.kill(first, signal.SIGSTOP)
    step_until(
        sup, lambda: sup.state("w") is ChildState.RUNNING and sup.pid("w") not in (None, first)
    )
    assert any("no health answer for 1 s; killing it" in m for m in messages)
    assert not pid_alive(first)


def test_a_child_back_with_another_fingerprint_is_not_let_back(
    tmp_path: Path, make: object, messages: list[str]
) -> None:
    sup: Supervisor = make(policy=FAST)  # type: ignore[operator]
    sup.start(spec(tmp_path))
    sup.wait_ready(["w"], time.monotonic() + 15)
    (tmp_path / "w.fp").write_text("digest-b")
    pid = sup.pid("w")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    step_until(sup, lambda: sup.state("w") is ChildState.GIVEN_UP)
    (status,) = sup.statuses()
    assert status.reason is not None and "restarted with fingerprint digest-b, expected" in (
        status.reason
    )
    assert status.pid is None and not any(pid_alive(p) for p in sup.all_pids())


def test_a_child_that_never_starts_is_a_launch_error(tmp_path: Path, make: object) -> None:
    sup: Supervisor = make()  # type: ignore[operator]
    broken = ChildSpec("bad", ChildKind.ROUTER, (sys.executable, "-c", "raise SystemExit(2)"),
                       command=True, health_url=f"http://127.0.0.1:{free_port()}")  # fmt: skip
    sup.start(broken)
    with pytest.raises(LaunchError, match="bad: exited with exit code 2 before it was ready"):
        sup.wait_ready(["bad"], time.monotonic() + 15)
