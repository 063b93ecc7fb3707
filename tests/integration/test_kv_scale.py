"""KV handoff at real-model scale, over every transport, through real worker processes.

The checkpoint (`kv_heavy_model_path`) has 2 MiB KV blocks; workers send frames of 256 KiB, so
every block travels as several byte-range chunks. For each transport (TCP, shared memory,
NIXL) asked for explicitly on both workers: the router's disaggregated greedy text equals the
offline engine's, its /metrics count only successful handoffs and no fallback, and the workers'
/metrics say the bytes went over that transport, with no downgrade and the canary exact.
With `auto` the best transport is used and named in health. A pair whose explicit transports
do not meet is refused before any prefill, naming why; a 4096-token prompt hands off.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_auth import signed_headers, signed_reservation
from worker_proc import WorkerHandle, launch_worker, router_process, wait_ready, worker_processes

from pdserve import LLM
from pdserve.observability.exposition import Sample, parse, total
from pdserve.protocol.sampling import SamplingParams
from pdserve.transfer.nixl_transport import nixl_available

FRAME = str(256 << 10)
KV_CACHE = str(320 << 20)  # 160 blocks of 2 MiB
PROMPT_LEN = 150  # 10 blocks: 20 MiB of KV per request
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def http(url: str, body: object | None = None, sign: bool = False) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    path = urllib.request.Request(url).selector
    headers = signed_headers("POST" if data else "GET", path, data or b"") if sign else {}
    headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data, headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def metrics(url: str) -> list[Sample]:
    status, raw = http(f"{url}/metrics")
    assert status == 200
    return parse(raw.decode())


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def reference(kv_heavy_model_path: Path) -> list[list[int]]:
    llm = LLM(model=str(kv_heavy_model_path), kv_cache_bytes=128 << 20)
    params = SamplingParams(**GREEDY)  # type: ignore[arg-type]
    return [o.token_ids for o in llm.generate(prompts(3, PROMPT_LEN, 1), params)]


def cluster(
    model: Path,
    workdir: Path,
    prefill_transport: str,
    decode_transport: str,
    worker_args: tuple[str, ...] = (),
) -> Iterator[tuple[list[WorkerHandle], str]]:
    with worker_processes() as handles:
        for role, transport in (("prefill", prefill_transport), ("decode", decode_transport)):
            extra = ["--kv-transport", transport, "--kv-frame-bytes", FRAME]
            extra += ["--kv-cache-bytes", KV_CACHE, *worker_args]
            handles.append(launch_worker(role, workdir, model=model, extra_args=extra))
        for handle in handles:
            wait_ready(handle)
        args = ["--local-prefill-threshold", "0", "--no-breaker", "--lease-ttl-s", "10"]
        with router_process(workdir, model, [h.url for h in handles], extra_args=args) as url:
            yield handles, url


TRANSPORTS = [
    "tcp",
    "shm",
    pytest.param(
        "nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl does not import")
    ),
]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_disaggregated_text_equals_offline_over_each_transport(
    transport: str,
    kv_heavy_model_path: Path,
    reference: list[list[int]],
    tmp_path: Path,
) -> None:
    check_cluster(kv_heavy_model_path, reference, tmp_path, transport)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_kv_staged_through_a_host_mirror_as_on_a_gpu_equals_offline(
    transport: str,
    kv_heavy_model_path: Path,
    reference: list[list[int]],
    tmp_path: Path,
) -> None:
    """Both workers compute in one tensor and hand off through a host mirror of it (what a
    GPU worker does, `--kv-host-staging` on the CPU): same text, same metrics."""
    staging = ("--kv-host-staging",)
    check_cluster(kv_heavy_model_path, reference, tmp_path, transport, staging)


def check_cluster(
    kv_heavy_model_path: Path,
    reference: list[list[int]],
    tmp_path: Path,
    transport: str,
    worker_args: tuple[str, ...] = (),
) -> None:
    """Disaggregated greedy text equals offline, with the transport's metrics as asked."""
    for (prefill, decode), url in cluster(
        kv_heavy_model_path, tmp_path, transport, transport, worker_args
    ):
        model = kv_heavy_model_path.name
        for prompt, want in zip(prompts(3, PROMPT_LEN, 1), reference, strict=True):
            body = {"model": model, "prompt": prompt, **GREEDY, "return_token_ids": True}
            status, raw = http(f"{url}/v1/completions", body)
            assert status == 200, raw
            assert json.loads(raw)["choices"][0]["token_ids"] == want
        router = metrics(url)
        # Committed, every one (a slow one counts against the breaker, which is off here).
        handoffs = total(router, "pdserve_router_kv_handoffs_total", outcome="ok")
        handoffs += total(router, "pdserve_router_kv_handoffs_total", outcome="slow")
        assert handoffs == 3
        assert total(router, "pdserve_router_kv_handoffs_total", outcome="failed") == 0
        assert total(router, "pdserve_router_fallbacks_total") == 0
        assert total(router, "pdserve_router_retries_total") == 0
        sent, received = metrics(prefill.url), metrics(decode.url)
        kv_bytes = 3 * 10 * (2 << 20)
        name = "pdserve_worker_kv_transport_bytes_total"
        assert total(sent, name, transport=transport, direction="sent") == kv_bytes
        assert total(received, name, transport=transport, direction="received") == kv_bytes
        assert total(sent, "pdserve_worker_kv_transport_downgrades_total") == 0
        assert total(received, "pdserve_worker_kv_canary_total", result="exact") == 3
        assert total(received, "pdserve_worker_kv_canary_total", result="mismatch") == 0
        # Through a host mirror, every byte is counted where it crossed it (never silent).
        staged = "pdserve_worker_kv_host_staged_bytes_total"
        mirrored = kv_bytes if "--kv-host-staging" in worker_args else 0
        assert total(sent, staged, direction="out") == mirrored
        assert total(received, staged, direction="in") == mirrored
        status, raw = http(f"{decode.url}/health")
        served = [e["transport"] for e in json.loads(raw)["kv_endpoints"]]
        assert served == [transport]


def test_explicit_transports_that_do_not_meet_are_refused_before_any_prefill(
    kv_heavy_model_path: Path, tmp_path: Path
) -> None:
    for (prefill, decode), _ in cluster(kv_heavy_model_path, tmp_path, "shm", "tcp"):
        request = {"request_id": "x", "prompt_token_ids": [5] * 40, "sampling": GREEDY}
        status, raw = http(f"{decode.url}/reserve", request, sign=True)
        assert status == 200, raw
        reservation = signed_reservation(json.loads(raw), decode.url)
        status, raw = http(f"{prefill.url}/prefill", {**request, "reservation": reservation}, True)
        error = json.loads(raw)
        assert (status, error["type"]) == (409, "TransportUnavailable"), error
        assert "shm (asked for here)" in error["error"] and "offers tcp" in error["error"]
        assert total(metrics(prefill.url), "pdserve_worker_prefill_tokens_total") == 0
        http(f"{decode.url}/release", {"request_id": "x"}, sign=True)


def test_a_4096_token_prompt_hands_off(kv_heavy_model_path: Path, tmp_path: Path) -> None:
    # 256 blocks of 2 MiB: half a gigabyte of KV in one handoff, over the best transport.
    with worker_processes() as handles:
        for role in ("prefill", "decode"):
            extra = ["--kv-cache-bytes", str(600 << 20), "--max-num-batched-tokens", "4096"]
            handles.append(
                launch_worker(role, tmp_path, model=kv_heavy_model_path, extra_args=extra)
            )
        for handle in handles:
            wait_ready(handle, timeout_s=120)
        args = ["--local-prefill-threshold", "0", "--no-breaker", "--lease-ttl-s", "20"]
        urls = [h.url for h in handles]
        with router_process(tmp_path, kv_heavy_model_path, urls, extra_args=args) as url:
            prompt = prompts(1, 4096, 9)[0]
            body = {"model": kv_heavy_model_path.name, "prompt": prompt, "max_tokens": 3}
            status, raw = http(f"{url}/v1/completions", {**body, "temperature": 0})
            assert status == 200, raw
            router = metrics(url)
            assert total(router, "pdserve_router_kv_handoffs_total", outcome="ok") == 1
            assert total(router, "pdserve_router_fallbacks_total") == 0
            received = metrics(handles[1].url)
            assert total(received, "pdserve_worker_kv_canary_total", result="exact") == 1
            name = "pdserve_worker_kv_transport_bytes_total"
            assert total(received, name, direction="received") == 256 * (2 << 20)
