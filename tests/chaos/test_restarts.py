"""A worker restarted at the same address is a new life, never mistaken for the old one (issue
30, instance epochs; issue 31, calls bound to their target).

Every worker process draws an instance id at start; its /health and membership record carry
it, and the router signs each call for `<worker id>/<instance id>`. Against real processes:
a call signed for a worker's previous life is refused with a typed, retryable 410, one signed
for another worker with a 403; and a prefill and a decode worker killed mid-handoff and
restarted at their ports under load cost no request and no token: the router sees the new
lives (their restarts counted in its /health) and every stream ends with the fault-free text.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cluster_auth import HTTP_KEY
from rolling import free_ports
from test_decode_death import health, stream_tokens
from waiting import until_sync
from worker_proc import WorkerHandle, launch_worker, router_process, wait_ready, worker_processes

from pdserve.auth.signing import auth_headers, call_target

pytestmark = pytest.mark.slow

# Each KV handoff waits 0.6 s in the prefill worker's sender, so the kill lands mid-handoff.
SLOW_HANDOFF = ("--fault", "transfer.send:delay:delay_s=0.6,times=0")


def signed_call(url: str, path: str, target: str | None) -> tuple[int, dict[str, object]]:
    """A signed GET to a worker, for `target`; the status and the JSON body."""
    headers = auth_headers(HTTP_KEY, "GET", path, b"", target)
    request = urllib.request.Request(url + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def recovery_steps(url: str) -> float:
    """`pdserve_router_retries_total` summed over its reasons."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("pdserve_router_retries_total")
    )


def test_a_call_for_a_previous_life_is_a_410_and_one_for_another_worker_a_403(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    (port,) = free_ports(1)
    path = "/debug/requests/nobody"
    with worker_processes() as started:
        args = ("--worker-id", "decode-0", "--port", str(port))
        first = wait_ready(
            launch_worker("decode", tmp_path, model=tiny_model_path, extra_args=args)
        )
        started.append(first)
        other = wait_ready(
            launch_worker("prefill", tmp_path, model=tiny_model_path,
                          extra_args=("--worker-id", "prefill-0"))
        )  # fmt: skip
        started.append(other)
        old = call_target("decode-0", str(first.health["instance_id"]))
        status, _ = signed_call(first.url, path, old)
        assert status not in (401, 403, 410)
        # The same call, meant for decode-0, at another worker: a replay across workers.
        status, body = signed_call(other.url, path, old)
        assert (status, body["type"]) == (403, "Forbidden")
        assert "signed for worker decode-0" in str(body["error"])

        first.proc.kill()
        first.proc.wait(10)
        again = wait_ready(
            launch_worker("decode", tmp_path, model=tiny_model_path, extra_args=args)
        )
        started.append(again)
        assert again.url == first.url
        assert again.health["instance_id"] != first.health["instance_id"]
        status, body = signed_call(again.url, path, old)
        assert (status, body["type"], body["retryable"]) == (410, "StaleInstance", True)
        new = call_target("decode-0", str(again.health["instance_id"]))
        assert signed_call(again.url, path, new)[0] not in (401, 403, 410)


def test_prefill_and_decode_restarted_at_their_ports_mid_handoff_serve_every_request(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    prefill_port, decode_port, kv_port = free_ports(3)
    prefill_args = ("--worker-id", "prefill-0", "--port", str(prefill_port))
    decode_args = ("--worker-id", "decode-0", "--port", str(decode_port), "--kv-port", str(kv_port))
    bodies = [
        {"model": "tiny-v2", "prompt": f"Story {i}: once upon a time", "max_tokens": 24,
         "ignore_eos": True, "temperature": 0.8, "seed": 100 + i}
        for i in range(4)
    ]  # fmt: skip
    with worker_processes() as handles:

        def start(role: str, args: tuple[str, ...]) -> WorkerHandle:
            handle = launch_worker(role, tmp_path, model=tiny_model_path, extra_args=args)
            handles.append(handle)
            return handle

        prefill = start("prefill", (*prefill_args, *SLOW_HANDOFF))
        decode = start("decode", decode_args)
        for handle in (prefill, decode):
            wait_ready(handle)
        with router_process(
            tmp_path,
            tiny_model_path,
            [prefill.url, decode.url],
            # Both workers are down while they restart: requests wait for them in the queue
            # (its default 5 s is shorter than a restart on a loaded machine).
            extra_args=("--lease-ttl-s", "4", "--queue-timeout-s", "60"),
        ) as url:
            references = [stream_tokens(url, body)[0] for body in bodies]
            results: dict[int, list[str] | BaseException] = {}

            def run(i: int) -> None:
                try:
                    results[i] = stream_tokens(url, bodies[i])[0]
                except BaseException as exc:  # the test reports it below
                    results[i] = exc

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
            for t in threads:
                t.start()
            # Kill both once a handoff is under way (the decode worker holds a reservation).
            until_sync(
                lambda: any(w["num_inflight"] for w in health(url)["workers"]),  # type: ignore[attr-defined]
                timeout_s=30,
            )
            for handle in (prefill, decode):
                os.kill(handle.pid, signal.SIGKILL)
                handle.proc.wait(10)
            # The same addresses, new lives (the prefill worker no longer slow).
            for handle in (start("prefill", prefill_args), start("decode", decode_args)):
                wait_ready(handle)
            for t in threads:
                t.join(timeout=120)
            assert results == dict(enumerate(references))
            # The kills landed inside requests: the router took recovery steps for them.
            assert recovery_steps(url) >= 1
            # The router saw both new lives and counts each restart once.
            until_sync(
                lambda: [w["num_restarts"] for w in health(url)["workers"]] == [1, 1],  # type: ignore[attr-defined]
                timeout_s=10,
            )
