"""A rolling restart of every worker under load, with the graceful drain (issue 30 D1).

Two prefill and two decode workers behind one router, at fixed ports, under a steady stream
of requests from three clients. One worker at a time gets SIGTERM: it drains (its /health
says so, new work goes elsewhere, what it holds finishes), exits 0 on its own, and a new
process starts at its address. Asserted as a user sees it: every request completes with the
fault-free text, no decode stream had to migrate, and each worker was seen restarted once;
`POST /admin/drain` (signed) drains a worker the same way.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from rolling import FixedWorkers, SteadyLoad, p99
from test_decode_death import health, stream_tokens
from waiting import until_sync
from worker_proc import launch_worker, router_process, wait_ready, worker_processes

pytestmark = pytest.mark.slow

DRAIN = ("--drain-timeout-s", os.environ.get("PDSERVE_TEST_DRAIN_S", "20"))
# PDSERVE_TEST_DRAIN_S=0 runs the same restart without the drain, to compare (by hand).
DRAINS = DRAIN[1] != "0"
# Tokens leave each decode worker every 20 ms: a stream lasts about a second, so a stop
# without a drain lands inside streams.
SLOW = {False: (), True: ("--fault", "worker.decode_tokens:delay:delay_s=0.02,times=0")}
NUM_CLIENTS = 3


def body(i: int) -> dict[str, object]:
    return {"model": "tiny-v2", "prompt": f"Story {i % 5}: the river", "max_tokens": 40,
            "ignore_eos": True, "temperature": 0.8, "seed": 7 + i % 5}  # fmt: skip


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))


def test_a_rolling_restart_with_drain_fails_nothing_and_migrates_nothing(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    with worker_processes() as handles:
        workers = FixedWorkers(tmp_path, handles, lambda role: (*DRAIN, *SLOW[role == "decode"]))
        running = {name: workers.start(name, tiny_model_path) for name in workers.specs}
        for handle in running.values():
            wait_ready(handle)
        urls = [h.url for h in running.values()]
        with router_process(tmp_path, tiny_model_path, urls) as url:
            references = {i: stream_tokens(url, body(i))[0] for i in range(5)}
            before = metric(url, "pdserve_router_retries_total")
            drain_s: list[float] = []
            back_s: list[float] = []
            with SteadyLoad(url, body, NUM_CLIENTS).running() as load:
                until_sync(lambda: load.count() >= 12, timeout_s=60)  # the steady baseline
                restart_began = time.monotonic()
                for name in workers.specs:
                    old = running[name]
                    until_sync(lambda: load.count() >= 2, timeout_s=60)  # under load
                    started = time.monotonic()
                    old.terminate()
                    assert old.proc.wait(30) == 0, old.log()  # drained and left on its own
                    drain_s.append(time.monotonic() - started)
                    if DRAINS:
                        assert "drained after" in old.log(), old.log()[-2000:]
                    relaunched = time.monotonic()
                    running[name] = wait_ready(workers.start(name, tiny_model_path))
                    until_sync(
                        lambda n=name: any(
                            w["worker_id"] == n and w["healthy"] and w["num_restarts"] == 1
                            for w in health(url)["workers"]  # type: ignore[attr-defined]
                        ),
                        timeout_s=10,
                    )
                    back_s.append(time.monotonic() - relaunched)
                    done = load.count()
                    until_sync(lambda d=done: load.count() >= d + 2, timeout_s=60)
            wrong = [(i, got) for i, got in load.outcomes if got != references[i % 5]]
            assert wrong == [] and len(load.outcomes) >= 12
            migrations = metric(url, "pdserve_router_migrations_total")
            steps_taken = metric(url, "pdserve_router_retries_total") - before
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
                steps = [line for line in resp.read().decode().splitlines()
                         if line.startswith("pdserve_router_retries_total")]  # fmt: skip
            # Drained, nothing is cut: no stream migrates, and the only steps are requests that
            # raced a worker's draining flag and were placed again before any work (refused at
            # the reservation or at /generate, so nothing recomputed). How many race depends on
            # the machine's load, not on the drain.
            placed_again = ('reason="reserve_refused"', 'reason="worker_refused"')
            recomputing = [line for line in steps if not any(r in line for r in placed_again)]
            assert not DRAINS or (migrations, recomputing) == (0, []), steps
            steady = [t for t in load.timings if t.start_s < restart_began]
            during = [t for t in load.timings if t.start_s >= restart_began]
            print(
                f"TTFT p99 {p99([t.ttft_s for t in steady]) * 1e3:.0f} ms steady,"
                f" {p99([t.ttft_s for t in during]) * 1e3:.0f} ms during the restart;"
                f" TPOT p99 {p99([t.tpot_s for t in steady]) * 1e3:.1f} ms steady,"
                f" {p99([t.tpot_s for t in during]) * 1e3:.1f} ms during"
            )
            print(
                f"rolling restart, drain {DRAIN[1]} s: {len(load.outcomes)} requests right,"
                f" stops took {', '.join(f'{s:.2f}' for s in drain_s)} s, recovery steps"
                f" {steps_taken:.0f}: {steps}; migrations {migrations:.0f}; serving again"
                f" {max(back_s):.2f} s at most after the relaunch"
            )


def test_admin_drain_is_signed_and_drains_the_worker(tiny_model_path: Path, tmp_path: Path) -> None:
    with worker_processes() as handles:
        handle = launch_worker(
            "decode", tmp_path, model=tiny_model_path, extra_args=("--worker-id", "d", *DRAIN)
        )
        handles.append(handle)
        wait_ready(handle)
        unsigned = urllib.request.Request(f"{handle.url}/admin/drain", data=b"", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(unsigned, timeout=10)
        assert refused.value.code == 401
        # `pdserve drain URL --wait` (the manifests' preStop hook) signs the call with the
        # cluster secret from the environment and returns once the worker has exited.
        done = subprocess.run(
            [sys.executable, "-m", "pdserve", "drain", handle.url, "--wait", "--timeout-s", "30"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert '"draining": true' in done.stdout and "drained and exited" in done.stdout
        assert handle.proc.wait(30) == 0
        assert "drained after" in handle.log()
        with socket.socket() as s:  # its port is free: it exited, not just stopped serving
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", int(handle.url.rsplit(":", 1)[1])))
