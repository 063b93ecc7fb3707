"""A decode worker paused (SIGSTOP) mid-stream: the router's health deadline drains it and the
stream migrates, so the client gets the fault-free text in seconds, not after the 120 s stream
silence timeout; once resumed (SIGCONT) the worker frees everything it held."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_decode_death import health, stream_tokens
from waiting import until_sync
from worker_proc import WorkerHandle, launch_worker, router_process, wait_ready, worker_processes

# Tokens leave each decode worker at most every 50 ms, so the stream is still running when
# the pause comes.
SLOW = ("--fault", "worker.decode_tokens:delay:delay_s=0.05,times=0")
DEADLINE_S = 2.0


@pytest.fixture
def cluster(tiny_model_path: Path, tmp_path: Path) -> Iterator[tuple[str, list[WorkerHandle]]]:
    with worker_processes() as handles:
        handles.append(launch_worker("prefill", tmp_path, model=tiny_model_path))
        for _ in range(2):
            handles.append(launch_worker("both", tmp_path, model=tiny_model_path, extra_args=SLOW))
        for handle in handles:
            wait_ready(handle)
        router_args = ("--health-deadline-s", str(DEADLINE_S), "--lease-ttl-s", "4")
        with router_process(
            tmp_path, tiny_model_path, [h.url for h in handles], extra_args=router_args
        ) as url:
            yield url, handles
        for h in handles:  # never leave a stopped process behind
            if h.proc.poll() is None:
                os.kill(h.pid, signal.SIGCONT)


def test_a_paused_decode_worker_is_drained_and_its_stream_migrates(
    cluster: tuple[str, list[WorkerHandle]],
) -> None:
    url, handles = cluster
    decodes = [h for h in handles if h.role == "both"]
    body = {"model": "tiny-v2", "prompt": "Once upon a time", "max_tokens": 120,
            "ignore_eos": True, "temperature": 0.9, "seed": 11}  # fmt: skip
    reference, _ = stream_tokens(url, body)
    paused: list[WorkerHandle] = []

    def pause_the_decoder(num_chunks: int) -> None:
        if num_chunks != 10 or paused:
            return
        # The engine may be done already (tokens wait in the slow writer): ask the router
        # which decode worker has the stream open.
        busy = {w["url"] for w in health(url)["workers"] if w["num_inflight"]}  # type: ignore[attr-defined]
        for h in decodes:
            if h.url in busy:
                os.kill(h.pid, signal.SIGSTOP)
                paused.append(h)
                return

    start = time.monotonic()
    pieces, finish = stream_tokens(url, body, pause_the_decoder)
    took = time.monotonic() - start
    assert paused, "no decode worker was running the request when the pause was due"
    assert finish == "length" and "".join(pieces) == "".join(reference)
    # Health timeout (2 s) + deadline + the rest of the stream elsewhere: far below 120 s.
    assert took < 30, f"the stream took {took:.1f} s"
    os.kill(paused[0].pid, signal.SIGCONT)

    def idle() -> bool:
        states = [health(h.url) for h in handles]
        return all((s["num_pinned_blocks"], s["num_running"]) == (0, 0) for s in states)

    # Nothing pinned or running anywhere within one lease TTL (4 s), the reaper's turn and
    # some slack for a loaded machine; returns as soon as that holds.
    until_sync(idle, timeout_s=4 + 2 + 4, what="no pinned block, nothing running")
