"""GPU check step: the one-GPU split cluster with its faults, and what the survivors hold after.

One prefill and three decode workers on the one device, a KV-heavy checkpoint. Once the cluster
is warm (and each worker's allocator figures read: `pdserve_worker_device_memory_bytes`), a
concurrent load runs while, overlapping:
- decode-0 SIGKILLs itself at the first KV chunk it receives (a kill mid-transfer);
- decode-1 is SIGSTOPped, by PID, inside its first KV receive (a fault plan holds it there for
  a moment so the pause lands mid-transfer) and SIGCONTed after the lease TTL plus 2 s.
Every request must end right: the offline engine's greedy tokens, through re-prefill or another
decode worker. One lease TTL after the load, no block may stay pinned, and each surviving
worker's allocated device memory must be back at its idle level (reserved bytes are reported:
torch's caching allocator keeps freed memory, so they are not judged). On the CPU there is no
allocator to read: the step still runs the faults and says so (`allocator`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pdlab.bench.gpu_check.disaggregated import completion_request, scrape, token_ids, workload
from pdlab.chaos.cluster import ChaosCluster, http_json
from pdlab.chaos.scenarios import LEASE_TTL_S, WorkerSpec
from pdserve.observability import metric_names as m
from pdserve.observability.exposition import total

PAUSE_S = LEASE_TTL_S + 2.0
# Allocated bytes may differ from idle by this much (a cuBLAS workspace, a stream's buffer).
MEMORY_SLACK_BYTES = 8 << 20
_DECODERS = ("decode-0", "decode-1", "decode-2")
_SURVIVORS = ("prefill-0", "decode-1", "decode-2")


def _complete(url: str, model: str, prompt: list[int], n: int) -> tuple[int, Any]:
    """(HTTP status, token ids or the error body) of one greedy completion."""
    request = completion_request(url, model, prompt, n)
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, token_ids(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")[:300]


def _memory(cluster: ChaosCluster, name: str) -> dict[str, float]:
    samples, spec = scrape(cluster.url(name)), m.WORKER_DEVICE_MEMORY.name
    return {k: total(samples, spec, kind=k) for k in ("allocated", "reserved")}


def _warm(cluster: ChaosCluster, url: str, n: int, rng: random.Random, length: int) -> int:
    """Rounds of concurrent requests until every worker has run an engine step; the rounds.

    Lazy device allocations come with a process's first forward and stay (torch keeps a
    cuBLAS workspace per handle and stream, several MiB and more on Hopper, from its
    allocator): read before it, a worker's idle level is too low, past the slack.
    Placement is round-robin, so one round of one request per decode worker reaches them all;
    later rounds are for a request that was refused or retried elsewhere."""
    for rounds in range(1, 6):
        batch = [[rng.randrange(3, 2000) for _ in range(length)] for _ in _DECODERS]
        with ThreadPoolExecutor(len(batch)) as pool:
            list(pool.map(lambda p: _complete(url, cluster.model_name, p, n), batch))
        steps = {w: total(scrape(cluster.url(w)), m.WORKER_STEPS.name) for w in cluster.workers}
        if all(steps.values()):
            return rounds
    raise RuntimeError(f"device faults: a worker never ran a step while warming: {steps}")


def _settle_memory(
    cluster: ChaosCluster, idle: dict[str, dict[str, float]], deadline_s: float
) -> dict[str, dict[str, float]]:
    """Survivors' allocator figures once allocated bytes are back within the slack of idle,
    or at the deadline (a transfer's buffer may be freed a moment after its blocks)."""
    end = time.monotonic() + deadline_s
    while True:
        now = {name: _memory(cluster, name) for name in idle}
        if _returned(idle, now) or time.monotonic() > end:
            return now
        time.sleep(0.2)


def _returned(idle: dict[str, dict[str, float]], now: dict[str, dict[str, float]]) -> bool:
    return all(abs(now[k]["allocated"] - idle[k]["allocated"]) <= MEMORY_SLACK_BYTES for k in idle)


def _pinned(cluster: ChaosCluster) -> dict[str, int]:
    return {n: int(cluster.health(n)["num_pinned_blocks"]) for n in _SURVIVORS}  # type: ignore[call-overload]


def _settle(cluster: ChaosCluster, want: dict[str, int], deadline_s: float) -> dict[str, int]:
    """Pinned blocks per survivor once they are back at `want`, or at the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        now = _pinned(cluster)
        if all(now[k] <= want[k] for k in want) or time.monotonic() > end:
            return now
        time.sleep(0.2)


class _PauseInReceive(threading.Thread):
    """SIGSTOP a worker as soon as its fault plan reports a hit, SIGCONT `PAUSE_S` later."""

    def __init__(self, cluster: ChaosCluster, name: str) -> None:
        super().__init__(daemon=True)
        self.cluster, self.name = cluster, name
        self.done = threading.Event()
        self.stopped_at: float | None = None
        self.resumed_at: float | None = None

    def run(self) -> None:
        url = f"{self.cluster.url(self.name)}/admin/faults"
        while not self.done.is_set():
            state = http_json(url, key=self.cluster.http_key)
            if int(state.get("num_injected", 0)):  # type: ignore[call-overload]
                break
            self.done.wait(0.02)
        else:
            return
        pid = self.cluster.workers[self.name].proc.pid
        os.kill(pid, signal.SIGSTOP)
        self.stopped_at = time.monotonic()
        try:
            self.done.wait(PAUSE_S)
        finally:
            os.kill(pid, signal.SIGCONT)
            self.resumed_at = time.monotonic()


def run(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Kill one decode worker and pause another mid-transfer under load; judge what users see."""
    sizes = (6, 128, 4) if args.quick else (12, 1024, 16)
    load = workload(workdir / "kv-heavy-faults", 2 if args.quick else 8, sizes, 7, args.device)
    path, prompts, want, n = load.path, load.prompts, load.want, load.n
    count, length = len(prompts), sizes[1]
    device = ("--device", args.device, "--kv-cache-bytes", str(1 << 30))
    workers = (
        WorkerSpec("prefill-0", "prefill", device),
        *(WorkerSpec(name, "both", device) for name in _DECODERS),
    )
    # Round-robin placement: every decode worker is warmed in the first round and takes its
    # share of the faulted load, whatever the load signals say (affinity placement could leave
    # one idle through every warm round: a CI run saw decode-2 get nothing in five).
    router = ("--no-breaker", "--routing", "round_robin")
    cluster = ChaosCluster(workers, router, workdir / "faults-cluster", str(path))
    pause = _PauseInReceive(cluster, "decode-1")
    try:
        url = cluster.start()
        warm_rounds = _warm(cluster, url, n, random.Random(8), length)
        idle_pins = _settle(cluster, dict.fromkeys(_SURVIVORS, 0), LEASE_TTL_S + 10)
        idle = {name: _memory(cluster, name) for name in _SURVIVORS}
        cluster.set_faults("decode-0", ("transfer.recv_chunk:crash",))
        cluster.set_faults("decode-1", ("transfer.recv_chunk:delay:delay_s=1",))
        pause.start()
        with ThreadPoolExecutor(count) as pool:
            answers = list(pool.map(lambda p: _complete(url, cluster.model_name, p, n), prompts))
        pause.done.set()
        pause.join(PAUSE_S + 10)
        after_pins = _settle(cluster, idle_pins, LEASE_TTL_S + 10)
        after = _settle_memory(cluster, idle, 10.0)
        dead = cluster.dead_workers()
    finally:
        pause.done.set()
        cluster.stop()
    identical = sum(a == (200, w) for a, w in zip(answers, want, strict=True))
    errors = [a for a in answers if a[0] != 200]
    memory = {
        name: {
            "idle_allocated": idle[name]["allocated"],
            "after_allocated": after[name]["allocated"],
            "idle_reserved": idle[name]["reserved"],
            "after_reserved": after[name]["reserved"],
        }
        for name in _SURVIVORS
    }
    returned = _returned(idle, after)
    paused_s = (
        pause.resumed_at - pause.stopped_at
        if pause.stopped_at is not None and pause.resumed_at is not None
        else None
    )
    leaked = sum(max(0, after_pins[k] - idle_pins[k]) for k in after_pins)
    report = {
        "requests": count,
        "completed_identical": identical,
        "errors": errors,
        "killed": "decode-0",
        "dead_workers": dead,
        "paused": "decode-1",
        "lease_ttl_s": LEASE_TTL_S,
        "paused_s": paused_s,
        "allocator": "cuda" if args.device == "cuda" else "none (cpu)",
        "memory": memory,
        "memory_returned": returned,
        "memory_slack_bytes": MEMORY_SLACK_BYTES,
        "warm_rounds": warm_rounds,
        "leaked_blocks": leaked,
    }
    report["passed"] = bool(
        identical == count
        and dead == ["decode-0"]
        and paused_s is not None
        and paused_s > LEASE_TTL_S
        and leaked == 0
        and returned
    )
    print("device faults:", json.dumps({k: v for k, v in report.items() if k != "memory"}))
    return report
