"""Transport attestation with real processes: when workers join, the router probes every
prefill/decode pair with throwaway KV at real-model block sizes, shows the rate in /health,
/metrics and `pdserve status`, and steers requests around a pair whose link is far too slow
(here a prefill worker whose every KV send waits 50 ms), while that pair's worker still serves
when it is the only one left."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from worker_proc import launch_worker, router_process, wait_ready, worker_processes

from pdserve.observability.exposition import parse

# Every send on the slow prefill worker's KV streams waits this long: a 32 MiB probe in 2 MiB
# blocks then runs far under a tenth of TCP's expected rate. Both prefill workers send over TCP
# (NIXL and shared memory move the data without stream sends: the fault would not slow them).
SLOW_SEND = "transfer.send:delay:delay_s=0.05,times=0"
OVER_TCP = ["--kv-transport", "tcp"]


def get_json(url: str) -> dict:  # type: ignore[type-arg]
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def wait_pairs(router_url: str, count: int, timeout_s: float = 60.0) -> list[dict]:  # type: ignore[type-arg]
    """The router's probed pairs once there are `count` of them."""
    deadline = time.monotonic() + timeout_s
    while True:
        pairs = get_json(f"{router_url}/health")["kv_pairs"]
        if len(pairs) >= count:
            return pairs  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"only {pairs} probed in {timeout_s} s"
        time.sleep(0.1)


def kv_sends(worker_url: str) -> float:
    """KV handoffs a prefill worker sent (from its /metrics; probes are not counted)."""
    with urllib.request.urlopen(f"{worker_url}/metrics", timeout=10) as resp:
        samples = parse(resp.read().decode())
    return sum(s.value for s in samples if s.name == "pdserve_worker_transfers_sent_total")


def complete(router_url: str, prompt: str) -> str:
    body = {"model": "kv-heavy", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(
        f"{router_url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return str(json.loads(resp.read())["choices"][0]["text"])


def test_pairs_are_attested_and_a_slow_one_steered_around(
    kv_heavy_model_path: Path, tmp_path: Path
) -> None:
    with worker_processes() as handles:
        fast = launch_worker("prefill", tmp_path, model=kv_heavy_model_path, extra_args=OVER_TCP)
        slow = launch_worker(
            "prefill",
            tmp_path,
            model=kv_heavy_model_path,
            extra_args=[*OVER_TCP, "--fault", SLOW_SEND],
        )
        decode = launch_worker("decode", tmp_path, model=kv_heavy_model_path)
        handles += [fast, slow, decode]
        for h in handles:
            wait_ready(h)
        urls = [h.url for h in handles]
        probes = ("--kv-probe-mib", "32")  # the test environment turns them off (conftest)
        with router_process(tmp_path, kv_heavy_model_path, urls, extra_args=probes) as router_url:
            pairs = {p["prefill"]: p for p in wait_pairs(router_url, 2)}
            assert pairs[fast.url]["verdict"] == "ok", pairs
            assert pairs[fast.url]["transport"] == pairs[slow.url]["transport"] == "tcp"
            assert pairs[fast.url]["gbps"] > pairs[slow.url]["gbps"] > 0, pairs
            assert pairs[slow.url]["verdict"] == "slow", pairs
            assert "expected" in pairs[slow.url]["detail"]

            # The slow pair's probe counted against the KV path, as a failed handoff would.
            health = get_json(f"{router_url}/health")
            assert health["breaker"]["failure_rate"] > 0, health["breaker"]
            with urllib.request.urlopen(f"{router_url}/metrics", timeout=10) as resp:
                samples = parse(resp.read().decode())
            rates = {
                dict(s.labels)["prefill"]: (dict(s.labels)["verdict"], s.value)
                for s in samples
                if s.name == "pdserve_router_kv_pair_gigabytes_per_second"
            }
            assert rates[slow.url][0] == "slow" and rates[fast.url][0] == "ok", rates
            probes = {
                dict(s.labels)["verdict"]: s.value
                for s in samples
                if s.name == "pdserve_router_kv_pair_probes_total"
            }
            assert probes == {"ok": 1.0, "slow": 1.0}, probes

            status = subprocess.run(
                [sys.executable, "-m", "pdserve", "status", "--url", router_url],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert status.returncode == 0, status.stderr
            assert "kv pair (prefill -> decode)" in status.stdout
            assert any(
                "slow" in line and "expected" in line for line in status.stdout.splitlines()
            ), status.stdout

            # Requests go through the fast pair only (the probes were each pair's one send).
            before_slow, before_fast = kv_sends(slow.url), kv_sends(fast.url)
            texts = [complete(router_url, f"Once upon a time {i} " * 8) for i in range(6)]
            assert all(texts)
            assert kv_sends(slow.url) == before_slow
            assert kv_sends(fast.url) == before_fast + 6

            # With the fast prefill worker gone, the slow pair still serves.
            fast.proc.kill()
            fast.proc.wait(10)
            deadline = time.monotonic() + 30
            while any(
                w["healthy"]
                for w in get_json(f"{router_url}/health")["workers"]
                if w["url"] == fast.url
            ):
                assert time.monotonic() < deadline, "the router still calls the killed worker"
                time.sleep(0.1)
            assert complete(router_url, "A last request " * 8)
            assert kv_sends(slow.url) == before_slow + 1
