"""Multi-turn affinity against real processes: one prefill worker, two `both` decode workers.

Each turn's prompt is the previous prompt + the previous output + a new user message (token
ids, greedy, ignore_eos so the output length is exact). Worker /metrics counters prove the
work done: tokens prefilled (and where), KV blocks received. The last test SIGKILLs (by PID)
the decode worker holding a conversation; the next turn must still succeed and the one after
must be suffix-only on the new holder.
"""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from worker_proc import WorkerHandle, launch_worker, router_process, wait_ready, worker_processes

MODEL = "tiny-v2"
BS = 16  # the workers' default KV block size
OUT = 8  # output tokens per turn
# Uncached prompt tokens up to which the holder prefills a suffix itself.
THRESHOLD = 64
# No pair probes: they send KV and take prefill work, and this module counts both exactly.
ROUTER_ARGS = (
    "--routing", "affinity", "--local-prefill-threshold", str(THRESHOLD), "--kv-probe-mib", "0",
)  # fmt: skip
_METRIC = re.compile(r'^pdserve_worker_(\w+)\{worker_id="[^"]*"\} (\S+)$', re.MULTILINE)


@dataclass(frozen=True, slots=True)
class Cluster:
    router: str
    prefill: WorkerHandle
    decodes: tuple[WorkerHandle, WorkerHandle]


@pytest.fixture(scope="module")
def cluster(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("affinity-cluster")
    with worker_processes() as handles:
        for role in ("prefill", "both", "both"):
            handles.append(launch_worker(role, workdir, model=tiny_model_path))
        for handle in handles:
            wait_ready(handle)
        urls = [h.url for h in handles]
        with router_process(workdir, tiny_model_path, urls, extra_args=ROUTER_ARGS) as url:
            yield Cluster(url, handles[0], (handles[1], handles[2]))


def counters(worker: WorkerHandle) -> dict[str, float]:
    with urllib.request.urlopen(f"{worker.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {name: float(value) for name, value in _METRIC.findall(text)}


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def turn(router: str, prompt: list[int], session: str) -> list[int]:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": OUT,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "user": session,
    }
    req = urllib.request.Request(
        f"{router}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        data = json.loads(resp.read())
    ids: list[int] = data["choices"][0]["token_ids"]
    assert len(ids) == OUT
    return ids


def user_message(seed: int, n: int) -> list[int]:
    return [(seed * 131 + 17 * i) % 1900 + 40 for i in range(n)]


def snapshot(c: Cluster) -> list[dict[str, float]]:
    return [counters(w) for w in (c.prefill, *c.decodes)]


def test_next_turn_prefills_only_the_suffix_on_the_holder(cluster: Cluster) -> None:
    t1 = user_message(1, 100)
    before = snapshot(cluster)
    out1 = turn(cluster.router, t1, "chat-a")
    after = snapshot(cluster)
    # Turn 1: the prefill worker computed the whole prompt; one decode worker received it all.
    assert delta(before[0], after[0], "prefill_tokens_total") == len(t1)
    received = [delta(before[i], after[i], "kv_received_blocks_total") for i in (1, 2)]
    assert sorted(received) == [0, -(-len(t1) // BS)]
    holder = 1 + received.index(max(received))

    t2 = [*t1, *out1, *user_message(2, 20)]
    before = after
    turn(cluster.router, t2, "chat-a")
    after = snapshot(cluster)
    # The holder computed the prompt and all but the last output token: whole blocks of them.
    held = (len(t1) + OUT - 1) // BS * BS
    assert len(t2) - held <= THRESHOLD  # short suffix: local prefill on the holder
    assert delta(before[holder], after[holder], "prefill_tokens_total") == len(t2) - held
    assert delta(before[holder], after[holder], "prefill_cached_tokens_total") == held
    for i in range(3):
        assert delta(before[i], after[i], "kv_received_blocks_total") == 0
        if i != holder:
            assert delta(before[i], after[i], "prefill_tokens_total") == 0


def test_a_long_suffix_is_prefilled_remotely_and_only_missing_blocks_travel(
    cluster: Cluster,
) -> None:
    t1 = user_message(3, 100)
    before = snapshot(cluster)
    out1 = turn(cluster.router, t1, "chat-b")
    after = snapshot(cluster)
    holder = 1 + max(
        (0, 1), key=lambda i: delta(before[1 + i], after[1 + i], "kv_received_blocks_total")
    )

    t2 = [*t1, *out1, *user_message(4, THRESHOLD + 40)]
    before = after
    turn(cluster.router, t2, "chat-b")
    after = snapshot(cluster)
    held_by_decode = (len(t1) + OUT - 1) // BS * BS
    held_by_prefill = len(t1) // BS * BS  # the prefill worker computed turn 1's prompt only
    assert len(t2) - held_by_decode > THRESHOLD
    # The prefill worker reused its own prefix and computed the rest.
    assert delta(before[0], after[0], "prefill_tokens_total") == len(t2) - held_by_prefill
    assert delta(before[0], after[0], "prefill_cached_tokens_total") == held_by_prefill
    # The session's decode worker got only the blocks after what it already held.
    blocks = delta(before[holder], after[holder], "kv_received_blocks_total")
    assert blocks == -(-len(t2) // BS) - held_by_decode // BS
    assert delta(before[holder], after[holder], "kv_received_cached_tokens_total") == (
        held_by_decode
    )
    other = 3 - holder
    assert delta(before[other], after[other], "kv_received_blocks_total") == 0
    assert delta(before[holder], after[holder], "prefill_tokens_total") == 0


def test_killing_the_holder_moves_the_conversation(cluster: Cluster) -> None:
    t1 = user_message(5, 100)
    before = snapshot(cluster)
    out1 = turn(cluster.router, t1, "chat-c")
    after = snapshot(cluster)
    holder = 1 + max(
        (0, 1), key=lambda i: delta(before[1 + i], after[1 + i], "kv_received_blocks_total")
    )
    survivor = 3 - holder
    victim = cluster.decodes[holder - 1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.proc.wait(10)

    t2 = [*t1, *out1, *user_message(6, 20)]
    before_survivor = counters(cluster.decodes[survivor - 1])
    out2 = turn(cluster.router, t2, "chat-c")  # re-prefilled elsewhere, still answered
    after_survivor = counters(cluster.decodes[survivor - 1])
    worked = delta(before_survivor, after_survivor, "prefill_tokens_total") + BS * delta(
        before_survivor, after_survivor, "kv_received_blocks_total"
    )
    assert worked >= len(t2) - BS  # the survivor got the whole conversation, not a suffix

    # Turn 3: the survivor is the holder now, so only the new suffix is prefilled there.
    t3 = [*t2, *out2, *user_message(7, 20)]
    before_survivor = after_survivor
    turn(cluster.router, t3, "chat-c")
    after_survivor = counters(cluster.decodes[survivor - 1])
    held = (len(t2) + OUT - 1) // BS * BS
    assert delta(before_survivor, after_survivor, "prefill_tokens_total") == len(t3) - held
    assert delta(before_survivor, after_survivor, "kv_received_blocks_total") == 0
