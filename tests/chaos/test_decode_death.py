"""Decode worker killed (SIGKILL) mid-stream: the client's stream continues on another worker
with no token lost or repeated, and the text equals the fault-free text (greedy and seeded)."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from worker_proc import (
    WorkerHandle,
    launch_worker,
    router_process,
    wait_ready,
    worker_processes,
)


@pytest.fixture
def cluster(tiny_model_path: Path, tmp_path: Path) -> Iterator[tuple[str, list[WorkerHandle]]]:
    """A fresh router over one prefill and two `both` workers (each case kills one)."""
    workdir = tmp_path
    with worker_processes() as handles:
        for role in ("prefill", "both", "both"):
            handles.append(launch_worker(role, workdir, model=tiny_model_path))
        for handle in handles:
            wait_ready(handle)
        with router_process(workdir, tiny_model_path, [h.url for h in handles]) as url:
            yield url, handles


def health(url: str) -> dict[str, object]:
    with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
        data: dict[str, object] = json.loads(resp.read())
        return data


def stream_tokens(
    url: str, body: dict[str, object], on_chunk: object = None
) -> tuple[list[str], str | None]:
    """The text pieces of a streamed completion, and its finish reason."""
    req = urllib.request.Request(
        f"{url}/v1/completions",
        json.dumps({**body, "stream": True}).encode(),
        {"Content-Type": "application/json"},
    )
    pieces: list[str] = []
    finish = None
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            pieces.append(choice["text"])
            finish = choice["finish_reason"] or finish
            if callable(on_chunk):
                on_chunk(len(pieces))
    return pieces, finish


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 7}])
def test_kill_decode_mid_stream_loses_and_repeats_nothing(
    cluster: tuple[str, list[WorkerHandle]], sampling: dict[str, object]
) -> None:
    url, handles = cluster
    alive = [h for h in handles if h.role == "both"]
    body = {"model": "tiny-v2", "prompt": "Once upon a time", "max_tokens": 160,
            "ignore_eos": True, **sampling}  # fmt: skip
    reference, ref_finish = stream_tokens(url, body)
    assert ref_finish == "length"

    killed: list[WorkerHandle] = []

    def kill_the_decoder(num_chunks: int) -> None:
        if num_chunks != 5 or killed:
            return
        for h in alive:
            if int(health(h.url)["num_running"]) > 0:  # type: ignore[call-overload]
                os.kill(h.pid, signal.SIGKILL)
                h.proc.wait(5)
                killed.append(h)
                return

    pieces, finish = stream_tokens(url, body, kill_the_decoder)
    assert killed, "no decode worker was running the request when the kill was due"
    assert finish == "length"
    assert "".join(pieces) == "".join(reference)  # nothing lost, nothing repeated
    survivor = next(h for h in alive if h not in killed)
    h = health(survivor.url)
    assert (h["num_pinned_blocks"], h["num_running"]) == (0, 0)
    prefill = next(x for x in handles if x.role == "prefill")
    assert health(prefill.url)["num_pinned_blocks"] == 0
