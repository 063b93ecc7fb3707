"""A launcher that dies without stopping its children (SIGKILL, a crash) still leaves no worker
or router behind: each child watches its lifeline and stops itself, gracefully (exit status 0
after SIGTERM, its ports released)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from pdserve.child.lifeline import Lifeline
from pdserve.supervise.process import pid_alive

# The launcher: a worker and a router pointed at it, started as `pdserve up` starts them, their
# PIDs printed once both answer; then it waits to be killed.
LAUNCHER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from pdserve.supervise.process import spawn_child, wait_child_ready

    workdir, model = Path(sys.argv[1]), sys.argv[2]
    worker = spawn_child("worker", ["pdserve.worker.main", "--role", "both", "--host",
        "127.0.0.1", "--port", "0", "--kv-port", "0", "--model", model,
        "--drain-timeout-s", "0", "--insecure-no-auth"], workdir, threads=1)
    url = wait_child_ready(worker, time.monotonic() + 120)
    router = spawn_child("router", ["pdserve.router.main", "--host", "127.0.0.1", "--port",
        "0", "--model", model, "--worker", url], workdir)
    wait_child_ready(router, time.monotonic() + 60)
    print(json.dumps({"worker": worker.proc.pid, "router": router.proc.pid}), flush=True)
    time.sleep(3600)
    """
)


def test_children_stop_when_their_launcher_is_sigkilled(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path), str(tiny_model_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    pids: dict[str, int] = {}
    try:
        assert launcher.stdout is not None
        line = launcher.stdout.readline()
        assert line, f"the launcher exited first ({launcher.wait()}); see {tmp_path}"
        pids = json.loads(line)
        assert all(pid_alive(pid) for pid in pids.values())
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(pid_alive(pid) for pid in pids.values()):
            assert time.monotonic() < deadline, {n: pid_alive(p) for n, p in pids.items()}
            time.sleep(0.1)
        # Graceful: each said why it stopped, and the router finished its shutdown.
        for name in pids:
            log = (tmp_path / f"{name}.log").read_text()
            assert "the process that started this one is gone" in log, log[-2000:]
            assert "Traceback" not in log, log[-4000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in pids.values():
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


# A child that ignores SIGTERM (a stop that hangs): the lifeline still ends it after its grace.
STUBBORN = textwrap.dedent(
    """
    import signal, sys, time
    from pdserve.child.lifeline import watch_lifeline

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_lifeline(grace_s=0.5)
    print("watching", flush=True)
    time.sleep(60)
    sys.exit(0)
    """
)


def test_a_child_whose_graceful_stop_hangs_exits_after_the_grace_period() -> None:
    lifeline = Lifeline()
    child = subprocess.Popen(
        [sys.executable, "-c", STUBBORN],
        env={**os.environ, **lifeline.environment()},
        pass_fds=(lifeline.child_fd,),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lifeline.started()
    try:
        assert child.stdout is not None and child.stdout.readline() == "watching\n"
        cut = time.monotonic()
        lifeline.close()  # the launcher "dies"
        assert child.wait(30) == 1
        assert time.monotonic() - cut < 20
        assert "exiting" in (child.stderr.read() if child.stderr else "")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
