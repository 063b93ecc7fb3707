"""Paused processes (SIGSTOP ... SIGCONT past the lease TTL), real workers, real router.

A pause is not a crash: the process comes back and carries on from where it was, with its
sockets, its timers and its half-sent frames. Three cases from issue 14:
- a prefill worker paused again and again (1-2.5 s, lease TTL 1 s) under steady load: every
  request answers 200 with the fault-free text (before: 172 of 192 got HTTP 500);
- a sender paused in the middle of a chunk past the TTL, its reservation's blocks given to
  another computation, then resumed: that computation's text is unchanged and the stale
  transfer is refused (invariant 7, no write after the lease);
- two prefill workers paused in turn in front of one decode worker with 2 MiB KV blocks: every
  answer equals the fault-free text (before: 2 of 7 runs served a wrong answer with 200).
The last two run over TCP and over shared memory, where the sender names its KV by reference
and the receiver copies it (the single copy): there a fenced receiver is what must stop.
Every process is stopped by PID, and resumed before that whatever the test did.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_auth import signed_headers, signed_reservation
from worker_proc import WorkerHandle, launch_worker, router_process, wait_ready, worker_processes

from pdserve import LLM
from pdserve.observability.exposition import parse, total
from pdserve.protocol.sampling import SamplingParams


def http(url: str, body: object | None = None, timeout: float = 120) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def worker_metric(url: str, name: str, **labels: str) -> float:
    status, raw = http(f"{url}/metrics")
    assert status == 200
    return total(parse(raw.decode()), name, **labels)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(length)] for _ in range(n)]


@contextlib.contextmanager
def pausing(pids: list[int], stop_s: tuple[float, float], run_s: tuple[float, float], seed: int) -> Iterator[list[int]]:  # fmt: skip
    """Pause the processes in turn (SIGSTOP for a drawn time, then SIGCONT) until the block
    ends; yields the list of pauses done. Every process is resumed on the way out."""
    done = threading.Event()
    pauses: list[int] = []
    rng = random.Random(seed)

    def loop() -> None:
        i = 0
        while not done.is_set():
            pid = pids[i % len(pids)]
            os.kill(pid, signal.SIGSTOP)
            pauses.append(pid)
            done.wait(rng.uniform(*stop_s))
            os.kill(pid, signal.SIGCONT)
            done.wait(rng.uniform(*run_s))
            i += 1

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield pauses
    finally:
        done.set()
        thread.join()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def until_idle(workers: list[WorkerHandle], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        states = [json.loads(http(f"{w.url}/health")[1]) for w in workers]
        if all(
            s["num_pinned_blocks"] == 0 and s["num_active_leases"] == 0 and s["num_running"] == 0
            for s in states
        ):
            return
        assert time.monotonic() < deadline, f"workers not idle: {states}"
        time.sleep(0.2)


def run_load(
    url: str, model: str, work: list[tuple[list[int], list[int]]], until: float, threads: int
) -> list[tuple[int, bool]]:
    """Greedy requests from `work` (prompt, expected tokens) until `until`: (status, right)."""
    results: list[tuple[int, bool]] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        i = k
        while time.monotonic() < until:
            prompt, want = work[i % len(work)]
            body = {"model": model, "prompt": prompt, "max_tokens": len(want), "temperature": 0}
            status, raw = http(f"{url}/v1/completions", {**body, "return_token_ids": True,
                                                        "ignore_eos": True})  # fmt: skip
            right = status == 200 and json.loads(raw)["choices"][0]["token_ids"] == want
            with lock:
                results.append((status, right))
            i += threads

    pool = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return results


def references(model: Path, ps: list[list[int]], sampling: int | SamplingParams) -> list[list[int]]:
    """Offline tokens: greedy with `sampling` tokens, or the given params."""
    llm = LLM(model=str(model), kv_cache_bytes=256 << 20)
    params = (
        SamplingParams(max_tokens=sampling, temperature=0.0, ignore_eos=True)
        if isinstance(sampling, int)
        else sampling
    )
    return [o.token_ids for o in llm.generate(ps, params)]


def test_a_prefill_worker_paused_again_and_again_costs_no_request(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    ps = prompts(6, 60, 1)
    work = list(zip(ps, references(tiny_model_path, ps, 12), strict=True))
    with worker_processes() as handles:
        for role in ("prefill", "both"):
            handles.append(launch_worker(role, tmp_path, model=tiny_model_path))
        for handle in handles:
            wait_ready(handle)
        args = ["--lease-ttl-s", "1", "--local-prefill-threshold", "0"]
        with router_process(tmp_path, tiny_model_path, [h.url for h in handles], extra_args=args) as url:  # fmt: skip
            with pausing([handles[0].pid], (1.0, 2.5), (0.3, 1.0), seed=14) as pauses:
                results = run_load(url, "tiny-v2", work, time.monotonic() + 15, threads=2)
            assert len(pauses) >= 4
            statuses = [s for s, _ in results]
            assert 500 not in statuses
            assert statuses == [200] * len(statuses), statuses
            assert all(right for _, right in results)
            until_idle(handles)


def signed_post(url: str, body: object, timeout: float = 120) -> tuple[int, bytes]:
    data = json.dumps(body).encode()
    path = urllib.request.Request(url).selector
    req = urllib.request.Request(url, data, signed_headers("POST", path, data))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_sender_paused_mid_chunk_past_the_ttl_never_writes_into_reused_blocks(
    transport: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    """Driven over the workers' API, so the two leases can differ: the decode side's lapses
    after 1 s while the prefill side still holds its KV (30 s), so the resumed sender really
    sends its stale bytes, and only the receiver's fence stands in their way. Over shared
    memory the sender names its own KV by reference (the single copy) and the receiver copies:
    a fenced receiver must copy nothing more."""
    prompt = prompts(1, 150, 2)[0]  # 10 blocks of 64 KiB: one 640 KiB chunk
    other = prompts(1, 150, 5)[0]  # the request that gets the freed blocks
    # Seeded sampling: every token depends on the whole distribution, so KV changed under a
    # running request shows in its tokens (a tiny model's greedy text can be blind to it).
    seeded = {"max_tokens": 1000, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    want = references(tiny_model_path, [other], SamplingParams(**seeded))[0]  # type: ignore[arg-type]
    greedy = {"max_tokens": 300, "temperature": 0.0, "ignore_eos": True}
    with worker_processes() as handles:
        # The prefill worker stops 100 KB into its first chunk's data (send 2: after Hello and
        # Begin) for 2.5 s, during which the test also SIGSTOPs it: a real pause, mid-frame.
        # Its own chunk deadline is long, so when it wakes it does send the rest.
        fault = "transfer.send:delay:after=2,times=1,delay_s=2.5,offset=100000"
        extra = ["--fault", fault, "--kv-transport", transport]
        extra += ["--transfer-chunk-timeout-s", "10"]
        handles.append(launch_worker("prefill", tmp_path, model=tiny_model_path, extra_args=extra))
        # A decode-side cache too small for the victim's 1150 tokens unless it takes the
        # fenced reservation's blocks (checked below): the reuse is forced, not hoped for.
        small = ["--kv-transport", transport, "--kv-cache-bytes", str(75 * 64 * 1024)]
        handles.append(launch_worker("both", tmp_path, model=tiny_model_path, extra_args=small))
        for handle in handles:
            wait_ready(handle)
        prefill, decode = handles
        status, raw = http(f"{decode.url}/health")
        health = json.loads(raw)
        size = health["block_size"]
        reserved_blocks = -(-len(prompt) // size)
        victim_blocks = -(-(len(other) + seeded["max_tokens"]) // size)
        assert victim_blocks <= health["num_blocks"] < victim_blocks + reserved_blocks, health
        request = {"request_id": "stale", "prompt_token_ids": prompt, "sampling": greedy}
        status, raw = signed_post(f"{decode.url}/reserve", {**request, "lease_ttl_s": 1.0})
        assert status == 200, raw
        reservation = signed_reservation(json.loads(raw), decode.url)
        body = {**request, "reservation": reservation, "lease_ttl_s": 30.0}
        status, raw = signed_post(f"{prefill.url}/prefill", body)
        assert status == 200, raw
        time.sleep(0.5)  # the sender is in its mid-chunk stall now
        os.kill(prefill.pid, signal.SIGSTOP)
        try:
            # Past the decode side's 1 s TTL: it fences the connection and frees the blocks.
            deadline = time.monotonic() + 10
            while worker_metric(decode.url, "pdserve_worker_reservations_cancelled_total") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            # Another request takes the freed blocks and decodes from them.
            result: list[tuple[int, bytes]] = []
            gen = {"request_id": "victim", "prompt_token_ids": other, "sampling": seeded}
            client = threading.Thread(
                target=lambda: result.append(signed_post(f"{decode.url}/generate", gen))
            )
            client.start()
            time.sleep(0.3)
        finally:
            os.kill(prefill.pid, signal.SIGCONT)  # the stale sender sends the rest now
        client.join(120)
        status, raw = result[0]
        assert status == 200, raw
        tokens = [t for line in raw.splitlines() if line for t in json.loads(line)["token_ids"]]
        # The victim ran to its 1000th token, so (by the cache's size) it held at least
        # `victim_blocks + reserved_blocks - num_blocks` of the fenced reservation's blocks.
        assert tokens == want  # not one stale byte reached them
        assert worker_metric(decode.url, "pdserve_worker_kv_fenced_writers_total") >= 1
        # The resumed sender's retry names a transfer that no longer exists: refused.
        deadline = time.monotonic() + 20
        while worker_metric(prefill.url, "pdserve_worker_transfers_send_failed_total") < 1:
            assert time.monotonic() < deadline, prefill.log()[-3000:]
            time.sleep(0.2)
        assert "UNKNOWN_TRANSFER" in prefill.log(), prefill.log()[-3000:]
        until_idle(handles)


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_two_prefill_workers_paused_in_turn_never_serve_a_wrong_answer(
    transport: str, kv_heavy_model_path: Path, tmp_path: Path
) -> None:
    ps = prompts(4, 70, 3)  # 5 blocks of 2 MiB each
    work = list(zip(ps, references(kv_heavy_model_path, ps, 8), strict=True))
    extra = ["--kv-cache-bytes", str(200 << 20), "--kv-transport", transport]
    with worker_processes() as handles:
        for role in ("prefill", "prefill", "decode"):
            handles.append(
                launch_worker(role, tmp_path, model=kv_heavy_model_path, extra_args=extra)
            )
        for handle in handles:
            wait_ready(handle, timeout_s=120)
        args = ["--lease-ttl-s", "1", "--local-prefill-threshold", "0"]
        urls = [h.url for h in handles]
        with router_process(tmp_path, kv_heavy_model_path, urls, extra_args=args) as url:
            pids = [handles[0].pid, handles[1].pid]
            with pausing(pids, (1.0, 2.0), (0.2, 0.6), seed=7) as pauses:
                results = run_load(url, kv_heavy_model_path.name, work, time.monotonic() + 15, 2)
            assert len(pauses) >= 4
            assert [s for s, _ in results] == [200] * len(results)
            assert all(right for _, right in results), "a wrong answer was served"
            # The handoffs that went through really rode the transport under test.
            name = "pdserve_worker_kv_transport_bytes_total"
            moved = worker_metric(handles[2].url, name, transport=transport, direction="received")
            assert moved > 0
            until_idle(handles)


def test_a_reservation_that_expires_while_its_prefill_worker_is_paused_is_served_again(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """Issue 32's 502: a prefill worker paused after its prefill answered and before its KV
    left, long past the lease TTL. Nobody renews the decode reservation meanwhile (the router
    renews only while the prefill runs; then the KV's bytes would), so it expires and the
    decode worker no longer knows the request. That is a lost state the recovery table
    answers (a fresh reservation and prefill), never a 502: the client gets the fault-free
    tokens. A delay before the KV send (a fault site) only places the SIGSTOP deterministically
    between the answer and the send."""
    ps = prompts(1, 60, 21)
    [want] = references(tiny_model_path, ps, 10)
    hold = ["--fault", "transfer.send:delay:delay_s=0.8"]
    with worker_processes() as handles:
        for role in ("prefill", "prefill", "decode"):
            extra = hold if role == "prefill" else []
            handles.append(launch_worker(role, tmp_path, model=tiny_model_path, extra_args=extra))
        for handle in handles:
            wait_ready(handle)
        args = ["--lease-ttl-s", "1", "--local-prefill-threshold", "0"]
        urls = [h.url for h in handles]
        with router_process(tmp_path, tiny_model_path, urls, extra_args=args) as url:
            answer: list[tuple[int, bytes]] = []
            body = {"model": "tiny-v2", "prompt": ps[0], "max_tokens": len(want),
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            sent = threading.Thread(
                target=lambda: answer.append(http(f"{url}/v1/completions", body))
            )
            sent.start()
            # The prefill worker that answered holds its KV (a lease) for the delayed send.
            holder = None
            deadline = time.monotonic() + 20
            while holder is None:
                assert time.monotonic() < deadline, "no prefill worker ever held the KV"
                for h in handles[:2]:
                    if json.loads(http(f"{h.url}/health")[1])["num_active_leases"] > 0:
                        holder = h
                time.sleep(0.01)
            os.kill(holder.pid, signal.SIGSTOP)
            try:
                time.sleep(3.0)  # the pause itself: three lease TTLs
            finally:
                os.kill(holder.pid, signal.SIGCONT)
            sent.join(60)
            [(status, raw)] = answer
            assert status == 200, raw
            assert json.loads(raw)["choices"][0]["token_ids"] == want
            status, metrics = http(f"{url}/metrics")
            samples = parse(metrics.decode())
            retried = total(samples, "pdserve_router_retries_total", reason="reprefill")
            assert retried >= 1, "the expired reservation was never re-prefilled"
            until_idle(handles)
