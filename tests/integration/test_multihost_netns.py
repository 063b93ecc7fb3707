"""The disaggregated flow across "machines": one Linux network namespace per process.

    root ns: this test ── bridge (tests/netns.py) ──┬── ns etcd      etcd
                                                    ├── ns router    router   --discovery etcd://…
                                                    ├── ns prefill   prefill  --host <its address>
                                                    ├── ns decode-b  decode   --host 0.0.0.0 --advertise-host <its address>
                                                    └── ns decode-c  decode   --host <its address>

Nothing shares a loopback: every HTTP call, etcd call and KV transfer crosses the bridge, so
an address that only means something locally (a wildcard bind, 127.0.0.1) breaks the flow
here, where the loopback tests cannot see it. decode-b binds the wildcard and advertises its
address, as a pod or a multi-homed host does; decode-c binds its one address.

The namespace tests, each on a fresh cluster. First, in order: the router builds its pool from
etcd; bursts of completions are served disaggregated (each timeline RESERVED → … → COMMITTED →
DECODING, no retry) until both decode workers have been used; decode-c is SIGKILLed (by PID:
no lease revoke) and leaves the router's list through its lapsed lease within TTL + slack
while completions keep succeeding; then everything goes to decode-b, still disaggregated
with no retry. Second, the same but decode-c's machine goes silent (link down) instead: it
leaves through its lease too, and the requests it holds fail over after the router's call
timeout. They skip where namespaces cannot be made (not root, no `ip`, a container without
the permission); the first test checks the advertised KV address without namespaces, so it
runs everywhere.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from etcd_proc import start_etcd
from membership_proc import (
    Proc,
    get_json,
    pool,
    post_json,
    processes,
    router_args,
    spawn,
    wait_ready,
    wait_until,
    worker_args,
)
from netns import Lab, lab, require_netns

from pdserve.router.workers.client import ClientTimeouts

pytest.importorskip("aetcd", reason="the etcd extra is not installed: pip install pdserve[etcd]")

TTL_S = 2
# etcd sweeps lapsed leases every 0.5 s; then the watch, and a loaded 2-core machine.
SLACK_S = 3.0
# What a call to a silent worker waits before the router tries another one, and the time
# the request then needs elsewhere on a loaded 2-core machine (about 1 s idle).
CONTROL_TIMEOUT_S = ClientTimeouts().control_s
FAILOVER_SLACK_S = 5.0
CLEAN_DISAGG = ["RECEIVED", "ROUTED", "RESERVED", "PREFILLING", "PREFILLED", "TRANSFERRING",
                "COMMITTED", "DECODING", "FINISHED"]  # fmt: skip


def wait_ready_at(handle: Proc, host: str, timeout_s: float = 90.0) -> Proc:
    """`wait_ready` for a worker bound to a wildcard: its ready file names 0.0.0.0, which
    from another namespace is that namespace's own loopback; reach it at `host` instead."""
    deadline = time.monotonic() + timeout_s
    while not handle.ready_file.exists():
        if handle.proc.poll() is not None:
            raise RuntimeError(f"{handle.name} exited {handle.proc.returncode}:\n{handle.log()}")
        assert time.monotonic() < deadline, f"{handle.name} not ready:\n{handle.log()}"
        time.sleep(0.05)
    port = str(json.loads(handle.ready_file.read_text())["url"]).rpartition(":")[2]
    handle.url = f"http://{host}:{port}"
    get_json(f"{handle.url}/health")
    return handle


def complete(router_url: str, i: int, max_tokens: int = 4) -> tuple[int, dict[str, object]]:
    """A greedy completion; a prompt under one KV block, so its KV always travels (a prefix
    cache hit on the decode worker cannot skip the transfer)."""
    body = {"model": "tiny-v2", "prompt": f"Once upon a time {i}", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    return post_json(f"{router_url}/v1/completions", body)


def burst(router_url: str, start: int, n: int) -> list[tuple[int, dict[str, object]]]:
    """`n` overlapping completions, each started a little after the previous one: the router
    counts a request against its decode worker once it decodes, so a later request sees the
    earlier one's worker busy and goes to the other."""
    results: list[tuple[int, dict[str, object]] | BaseException] = [RuntimeError("no answer")] * n

    def one(k: int) -> None:
        try:
            time.sleep(0.1 * k)
            results[k] = complete(router_url, start + k, max_tokens=64)
        except BaseException as exc:  # reported below, with the others
            results[k] = exc

    threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    return [r for r in results if not isinstance(r, BaseException)]


def history_of(router_url: str, answer: dict[str, object]) -> list[tuple[str, str]]:
    """(state, detail) of each transition of an answered request's timeline on the router."""
    timeline = get_json(f"{router_url}/debug/requests/{answer['id']}")
    history = timeline["history"]
    assert isinstance(history, list)
    return [(str(t["state"]), str(t["detail"])) for t in history]


def assert_served_disaggregated(
    router_url: str, answers: list[tuple[int, dict[str, object]]], prefill_url: str
) -> set[str]:
    """Every answer 200 with a clean disaggregated timeline; returns the decode URLs used."""
    used = set()
    for status, body in answers:
        assert status == 200, body
        history = history_of(router_url, body)
        assert [state for state, _ in history] == CLEAN_DISAGG, history
        decode, prefill = dict(history)["ROUTED"].split(" ")
        assert prefill == f"prefill={prefill_url}", history
        used.add(decode.removeprefix("decode="))
    return used


@pytest.fixture
def namespaces_possible() -> None:
    # Requested first: the skip comes before the model is built and anything is started.
    require_netns()


def test_wildcard_bound_worker_advertises_a_reachable_kv_address(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """Without namespaces: what a decode worker bound to 0.0.0.0 tells others. Reservations
    carry its KV address to prefill workers on other machines, where 0.0.0.0 is themselves."""
    args = ["--role", "decode", "--host", "0.0.0.0", "--advertise-host", "127.0.0.1",
            "--port", "0", "--kv-port", "0", "--model", str(tiny_model_path)]  # fmt: skip
    with processes() as handles:
        handles.append(spawn("wildcard", "pdserve.worker.main", args, tmp_path))
        worker = wait_ready_at(handles[-1], "127.0.0.1")
        health = get_json(f"{worker.url}/health")
    host, _, port = str(health["transfer_address"]).rpartition(":")
    assert (host, port.isdigit()) == ("127.0.0.1", True), health["transfer_address"]


@dataclass(slots=True)
class Cluster:
    net: Lab
    router: Proc
    prefill: Proc
    decode_b: Proc
    decode_c: Proc

    def serve_on_both_decode_workers(self) -> None:
        """Bursts until both decode workers have served, each request disaggregated over the
        bridge with no retry: the wildcard-bound one must have handed the prefill worker an
        address it can reach for the KV."""
        both = {self.decode_b.url, self.decode_c.url}
        used: set[str] = set()
        for n in range(5):
            used |= assert_served_disaggregated(self.router.url, burst(self.router.url, 10 * n, 3),
                                                self.prefill.url)  # fmt: skip
            if used == both:
                return
        assert used == both, used


@contextlib.contextmanager
def cluster(model: Path, workdir: Path) -> Iterator[Cluster]:
    """etcd, a router, a prefill and two decode workers, each on its own machine; yields once
    the router lists the three workers from etcd, healthy."""
    with contextlib.ExitStack() as stack:
        # Exit order (reverse): processes stop (workers revoke their leases while etcd is
        # up), then etcd, then the namespaces and the bridge, which a live process would pin.
        net = stack.enter_context(lab(["etcd", "router", "prefill", "decode-b", "decode-c"]))
        addr = net.addresses
        etcd = start_etcd(workdir, host=addr["etcd"], wrap=net.wrap("etcd"))
        stack.callback(etcd.stop)
        handles = stack.enter_context(processes())
        discovery = etcd.uri("/multihost")

        def worker(machine: str, role: str, host: str, *extra: str) -> Proc:
            args = [*worker_args(role, host, discovery, TTL_S, model), *extra]
            handles.append(spawn(machine, "pdserve.worker.main", args, workdir, net.wrap(machine)))
            return handles[-1]

        prefill = worker("prefill", "prefill", addr["prefill"])
        decode_b = worker("decode-b", "decode", "0.0.0.0", "--advertise-host", addr["decode-b"])
        decode_c = worker("decode-c", "decode", addr["decode-c"])
        router_cmd = router_args(addr["router"], discovery, model)
        handles.append(spawn("router", "pdserve.router.main", router_cmd, workdir,
                             net.wrap("router")))  # fmt: skip
        router = handles[-1]
        for handle in (prefill, decode_c, router):
            wait_ready(handle)
        wait_ready_at(decode_b, addr["decode-b"])
        assert router.url.startswith(f"http://{addr['router']}:"), router.url
        expected = {prefill.url, decode_b.url, decode_c.url}
        wait_until(
            "the router lists the three workers from etcd, healthy",
            lambda: pool(router.url) == dict.fromkeys(expected, True),
            15,
        )
        yield Cluster(net, router, prefill, decode_b, decode_c)


def assert_only_decode_b_left(c: Cluster) -> None:
    """The router's list is the live workers, and new requests go disaggregated to decode-b."""
    assert pool(c.router.url) == {c.prefill.url: True, c.decode_b.url: True}
    health = get_json(f"{c.router.url}/health")
    assert health["status"] == "ok", health
    used = assert_served_disaggregated(c.router.url, burst(c.router.url, 200, 3), c.prefill.url)
    assert used == {c.decode_b.url}


def test_disaggregated_across_namespaces_dead_decode_worker_leaves(
    namespaces_possible: None, tiny_model_path: Path, tmp_path: Path
) -> None:
    with cluster(tiny_model_path, tmp_path) as c:
        c.serve_on_both_decode_workers()

        c.decode_c.kill()  # SIGKILL by PID: no revoke, only the lapsing lease tells etcd
        statuses: list[int] = []

        def gone_while_serving() -> bool:
            statuses.append(complete(c.router.url, 100 + len(statuses))[0])
            return c.decode_c.url not in pool(c.router.url)

        wait_until("the killed decode worker leaves the router's list",
                   gone_while_serving, TTL_S + SLACK_S)  # fmt: skip
        assert statuses and set(statuses) == {200}, statuses
        assert_only_decode_b_left(c)


def test_silent_decode_machine_leaves_and_requests_fail_over(
    namespaces_possible: None, tiny_model_path: Path, tmp_path: Path
) -> None:
    """decode-c's machine goes silent (its link down: no reset, no FIN; its keep-alives no
    longer reach etcd) while its process runs on. A killed process answers with a reset at
    once; silence is only ended by timeouts, which only a real network path shows."""
    with cluster(tiny_model_path, tmp_path) as c:
        c.serve_on_both_decode_workers()
        # Unplugged between requests: a reservation or prefill caught by the cut waits out
        # the router's control-call timeout, then goes elsewhere (a decode stream caught
        # mid-way would wait for the much longer stream-read timeout instead).
        c.net.unplug("decode-c")
        answers: list[tuple[int | str, float]] = []  # (status or error, seconds)
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                began = time.monotonic()
                try:
                    status: int | str = complete(c.router.url, 300 + len(answers))[0]
                except OSError as exc:  # a connection error or post_json's own timeout
                    status = repr(exc)
                answers.append((status, time.monotonic() - began))

        thread = threading.Thread(target=client)
        thread.start()
        try:
            # The lease, not the client's traffic, takes it out: poll the list on the side.
            wait_until("the silent decode worker leaves the router's list",
                       lambda: c.decode_c.url not in pool(c.router.url), TTL_S + SLACK_S)  # fmt: skip
        finally:
            stop.set()
            thread.join(CONTROL_TIMEOUT_S + 30)
        assert not thread.is_alive(), "a completion hung past the router's call timeouts"
        assert answers and {status for status, _ in answers} == {200}, answers
        # One timeout, then a normal request elsewhere: not a stream-read timeout (minutes).
        slowest = max(took for _, took in answers)
        assert slowest < CONTROL_TIMEOUT_S + FAILOVER_SLACK_S, answers
        assert_only_decode_b_left(c)
