"""Fail closed, with real processes: credentials, the KV canary, admission, clean ends.

- Only the cluster talks to workers: a control call without the credential is 401, a forged or
  replayed one 403, a reservation the router did not sign is refused before any prefill, a KV
  connection whose Hello has no valid MAC is refused; none of them leaves state behind.
- KV checked by value: KV damaged before its checksum (`transfer.source_kv`) or landed one block
  off (`transfer.recv_map`) fails its canary on the decode worker; the router recovers and the
  client gets the right text.
- The router refuses to start in front of workers that run another model, naming the fields.
- Colocated admission is bounded: 503 with Retry-After, never a queue without end, never 500.
- A stream that fails after its headers ends with an error event and [DONE]; a client that
  leaves a non-streamed request cancels it on the worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_auth import SECRET, signed_headers, signed_reservation
from worker_proc import WorkerHandle, launch_worker, router_process, wait_ready, worker_processes

from pdserve import LLM
from pdserve.auth.signing import AUTH_HEADER
from pdserve.errors import TransferRefused
from pdserve.observability.exposition import Sample, parse, total
from pdserve.protocol.sampling import SamplingParams
from pdserve.router.api import sse
from pdserve.transfer.messages import KVLayout, token_digest
from pdserve.transfer.sender import OutgoingTransfer, SendPolicy, send_with_retries
from pdserve.transfer.sender_session import SenderSession
from pdserve.transfer.tcp import open_tcp_stream

GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def http(
    url: str, body: object | None = None, headers: dict[str, str] | None = None, timeout: float = 60
) -> tuple[int, bytes, dict[str, str]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def signed_post(url: str, body: object) -> tuple[int, bytes]:
    raw = json.dumps(body).encode()
    path = urllib.request.Request(url).selector
    status, answer, _ = http(url, body, signed_headers("POST", path, raw))
    return status, answer


def metrics(url: str) -> list[Sample]:
    status, raw, _ = http(f"{url}/metrics")
    assert status == 200
    return parse(raw.decode())


def health(url: str) -> dict[str, object]:
    status, raw, _ = http(f"{url}/health")
    assert status == 200
    data: dict[str, object] = json.loads(raw)
    return data


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


@pytest.fixture(scope="module")
def pair(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerHandle, WorkerHandle]]:
    workdir = tmp_path_factory.mktemp("fail-closed")
    with worker_processes() as handles:
        for role in ("prefill", "decode"):
            extra = ["--kv-transport", "tcp", "--enable-fault-admin"]
            handles.append(launch_worker(role, workdir, model=tiny_model_path, extra_args=extra))
        for handle in handles:
            wait_ready(handle)
        yield handles[0], handles[1]


def test_control_calls_without_the_credential_are_refused_and_change_nothing(
    pair: tuple[WorkerHandle, WorkerHandle],
) -> None:
    _, decode = pair
    url = f"{decode.url}/reserve"
    body = {"request_id": "intruder", "prompt_token_ids": [5, 6, 7], "sampling": GREEDY}
    raw = json.dumps(body).encode()
    before = total(metrics(decode.url), "pdserve_worker_auth_refusals_total")
    status, answer, _ = http(url, body)
    assert (status, json.loads(answer)["type"]) == (401, "Unauthenticated")
    forged = signed_headers("POST", "/reserve", raw)
    forged[AUTH_HEADER] = forged[AUTH_HEADER][:-4] + "0000"
    status, answer, _ = http(url, body, forged)
    assert (status, json.loads(answer)["type"]) == (403, "Forbidden")
    other_path = signed_headers("POST", "/release", raw)  # signed for another endpoint
    assert http(url, body, other_path)[0] == 403
    # A genuine call, then the same bytes again: the replay is refused.
    genuine = signed_headers("POST", "/reserve", raw)
    assert http(url, body, genuine)[0] == 200
    status, answer, _ = http(url, body, genuine)
    assert (status, "already used" in json.loads(answer)["error"]) == (403, True)
    h = health(decode.url)
    assert h["num_active_leases"] == 1  # only the genuine reservation exists
    assert signed_post(f"{decode.url}/release", {"request_id": "intruder"})[0] == 200
    after = total(metrics(decode.url), "pdserve_worker_auth_refusals_total")
    assert after - before == 4


def test_a_reservation_the_router_did_not_sign_is_refused_before_any_prefill(
    pair: tuple[WorkerHandle, WorkerHandle],
) -> None:
    prefill, decode = pair
    request = {"request_id": "unsigned", "prompt_token_ids": prompt_of(40, 1), "sampling": GREEDY}
    status, raw = signed_post(f"{decode.url}/reserve", request)
    assert status == 200
    reservation = json.loads(raw)
    signed = signed_reservation(reservation, decode.url)
    # Redirected: the KV would go to an address the router never vouched for.
    tampered = json.loads(json.dumps(signed))
    tampered["reservation"]["endpoints"][0]["address"] = "127.0.0.1:9"
    expired = signed_reservation(reservation, decode.url, ttl_s=-1)
    before = total(metrics(prefill.url), "pdserve_worker_prefill_tokens_total")
    for bad, words in ((tampered, "signature does not match"), (expired, "expired")):
        status, raw = signed_post(f"{prefill.url}/prefill", {**request, "reservation": bad})
        error = json.loads(raw)
        assert (status, error["type"], words in error["error"]) == (403, "Forbidden", True)
    assert total(metrics(prefill.url), "pdserve_worker_prefill_tokens_total") == before
    assert signed_post(f"{decode.url}/release", {"request_id": "unsigned"})[0] == 200


def test_a_kv_connection_without_the_cluster_mac_is_refused(
    pair: tuple[WorkerHandle, WorkerHandle],
) -> None:
    _, decode = pair
    request = {
        "request_id": "kv-intruder",
        "prompt_token_ids": prompt_of(40, 2),
        "sampling": GREEDY,
    }
    status, raw = signed_post(f"{decode.url}/reserve", request)
    assert status == 200
    reservation = json.loads(raw)
    host, port = reservation["endpoints"][0]["address"].rsplit(":", 1)
    tid = bytes.fromhex(reservation["transfer_id"])
    layout = KVLayout(4, 3, 4096, "float32", 16)
    blocks = [memoryview(bytearray(4096)) for _ in range(3)]
    transfer = OutgoingTransfer(
        tid, "kv-intruder", 1, layout, 40, token_digest(request["prompt_token_ids"]),  # type: ignore[arg-type]
        bytes.fromhex(reservation["capability_token"]), blocks, epoch=reservation["lease_epoch"],
    )  # fmt: skip
    fingerprint = dict(decode.health["fingerprint"])  # type: ignore[call-overload]

    async def send(key: bytes | None, attempt: int) -> None:
        session = SenderSession(tid, fingerprint, cluster_key=key, attempt=attempt)
        await send_with_retries(
            lambda: open_tcp_stream((host, int(port))),
            session,
            transfer,
            SendPolicy(max_attempts=1),
            deadline=asyncio.get_running_loop().time() + 10,
        )

    with pytest.raises(TransferRefused, match="UNAUTHENTICATED"):
        asyncio.run(send(None, 1))  # knows the token, not the cluster secret
    with pytest.raises(TransferRefused, match="UNAUTHENTICATED"):
        asyncio.run(send(b"k" * 32, 2))  # another cluster's secret
    assert signed_post(f"{decode.url}/release", {"request_id": "kv-intruder"})[0] == 200
    refusals = metrics(decode.url)
    assert total(refusals, "pdserve_worker_transfer_refusals_total", reason="Unauthenticated") == 2
    _ = SECRET  # the test cluster's secret is what the workers hold


@pytest.fixture(scope="module")
def router_over_pair(
    pair: tuple[WorkerHandle, WorkerHandle],
    tiny_model_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("fail-closed-router")
    urls = [pair[0].url, pair[1].url]
    args = ["--local-prefill-threshold", "0", "--no-breaker", "--lease-ttl-s", "5"]
    with router_process(workdir, tiny_model_path, urls, extra_args=args) as url:
        yield url


@pytest.mark.parametrize(
    ("worker", "rule"),
    [(0, "transfer.source_kv:corrupt:times=1"), (1, "transfer.recv_map:shift:times=1")],
    ids=["kv-damaged-before-checksum", "blocks-landed-one-off"],
)
def test_kv_that_fails_its_canary_is_never_served(
    pair: tuple[WorkerHandle, WorkerHandle],
    router_over_pair: str,
    tiny_model_path: Path,
    worker: int,
    rule: str,
) -> None:
    decode = pair[1]
    target = pair[worker]
    prompt = prompt_of(70, 30 + worker)  # 5 blocks
    want = LLM(model=str(tiny_model_path)).generate([prompt], SamplingParams(**GREEDY))[0]  # type: ignore[arg-type]
    before = total(metrics(decode.url), "pdserve_worker_kv_canary_total", result="mismatch")
    assert signed_post(f"{target.url}/admin/faults", {"rules": [rule]})[0] == 200
    try:
        body = {"model": "tiny-v2", "prompt": prompt, **GREEDY, "return_token_ids": True}
        status, raw, _ = http(f"{router_over_pair}/v1/completions", body)
    finally:
        signed_post(f"{target.url}/admin/faults", {"rules": []})
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["token_ids"] == want.token_ids
    after = total(metrics(decode.url), "pdserve_worker_kv_canary_total", result="mismatch")
    assert after - before == 1
    router = metrics(router_over_pair)
    assert total(router, "pdserve_router_kv_handoffs_total", outcome="failed") >= 1


def test_the_router_refuses_to_start_before_workers_of_another_model(
    pair: tuple[WorkerHandle, WorkerHandle], kv_heavy_model_path: Path, tmp_path: Path
) -> None:
    args = [sys.executable, "-m", "pdserve.router.main", "--model", str(kv_heavy_model_path)]
    args += ["--worker", pair[0].url, "--worker", pair[1].url, "--port", "0"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "runs another model" in done.stderr
    assert "num_kv_heads 32 != 2" in done.stderr and "head_dim 128 != 64" in done.stderr


@pytest.fixture(scope="module")
def colocated(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerHandle, str]]:
    workdir = tmp_path_factory.mktemp("colocated")
    with worker_processes() as handles:
        extra = ["--max-num-seqs", "2", "--max-waiting", "1", "--enable-fault-admin"]
        handles.append(launch_worker("both", workdir, model=tiny_model_path, extra_args=extra))
        wait_ready(handles[0])
        args = ["--queue-timeout-s", "0"]
        with router_process(workdir, tiny_model_path, [handles[0].url], "colocated", args) as url:
            yield handles[0], url


def test_colocated_admission_is_bounded_with_503_and_retry_after(
    colocated: tuple[WorkerHandle, str],
) -> None:
    worker, url = colocated
    results: list[tuple[int, dict[str, str]]] = []

    def one(i: int) -> None:
        body = {"model": "tiny-v2", "prompt": prompt_of(300, 100 + i), "max_tokens": 4}
        status, _, headers = http(f"{url}/v1/completions", body, timeout=120)
        results.append((status, headers))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(s for s, _ in results)
    assert set(statuses) <= {200, 503} and 200 in statuses and 503 in statuses, statuses
    assert all(h.get("Retry-After") == "1" for s, h in results if s == 503)
    assert total(metrics(worker.url), "pdserve_worker_admission_refusals_total") >= 1


def test_a_stream_that_fails_after_its_headers_ends_with_an_error_event_and_done(
    colocated: tuple[WorkerHandle, str],
) -> None:
    worker, url = colocated
    rule = "worker.decode_tokens:close:after=3"
    assert signed_post(f"{worker.url}/admin/faults", {"rules": [rule]})[0] == 200
    try:
        body = {"model": "tiny-v2", "prompt": "hello", "max_tokens": 20, "stream": True}
        status, raw, _ = http(f"{url}/v1/completions", body)
    finally:
        signed_post(f"{worker.url}/admin/faults", {"rules": []})
    assert status == 200
    events = sse.parse_events(raw)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert "error" in last and last["error"]["type"] == "server_error", last
    # No status line (a late 504) written inside the body, and every event is whole JSON.
    # (Not a bare b"504" test: the `created` timestamp may contain those digits.)
    assert re.search(rb"HTTP/1\.[01] \d{3}", raw) is None, raw
    assert all(isinstance(json.loads(e), dict) for e in events[:-1]), events


def test_a_client_that_leaves_a_non_streamed_request_cancels_it_on_the_worker(
    colocated: tuple[WorkerHandle, str],
) -> None:
    worker, url = colocated
    body = {"model": "tiny-v2", "prompt": "bye", "max_tokens": 1500, "ignore_eos": True}
    started = time.monotonic()
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        http(f"{url}/v1/completions", body, timeout=1.0)  # gives up and closes the connection
    for _ in range(100):
        h = health(worker.url)
        if (h["num_running"], h["num_waiting"]) == (0, 0) and h["num_free_blocks"] == h[
            "num_blocks"
        ]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the worker still runs the abandoned request: {h}")
    # Far sooner than 1500 tokens would take.
    assert time.monotonic() - started < 15
    _ = os.getpid()
