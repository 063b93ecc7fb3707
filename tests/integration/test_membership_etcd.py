"""Membership through a real etcd: real worker and router processes on loopback.

One etcd and one registered cluster (a prefill and two decode workers, lease TTL 2 s) per
module; each test starts the routers it needs with `--discovery`, and the tests that kill or
stop workers start their own extra ones, so the shared workers stay up. Every process is
stopped by PID at the end. The time bounds are the TTL plus slack for etcd's lease sweep
(every 0.5 s) and the watch: a worker that left the pool's list did so through etcd, not
through a failed health poll, which only marks it unhealthy.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from etcd_proc import EtcdHandle, etcd_server, free_port, start_etcd
from membership_proc import (
    Proc,
    complete,
    pool,
    processes,
    router_args,
    spawn,
    wait_ready,
    wait_until,
    worker_args,
)

pytest.importorskip("aetcd", reason="the etcd extra is not installed: pip install pdserve[etcd]")

__all__ = ["etcd_server"]  # the fixture, imported for pytest

TTL_S = 2
# etcd sweeps expired leases every 0.5 s; the watch and a loaded 2-core machine add a little.
SLACK_S = 2.0


@dataclass(slots=True)
class Cluster:
    discovery: str
    model: Path
    workdir: Path
    workers: list[Proc]
    handles: list[Proc]

    def start_router(self, name: str) -> Proc:
        router = spawn(
            name, "pdserve.router.main", router_args("127.0.0.1", self.discovery, self.model),
            self.workdir,
        )  # fmt: skip
        self.handles.append(router)
        return wait_ready(router)

    def start_workers(self, *roles: str) -> list[Proc]:
        started = [
            spawn(
                f"{role}-{len(self.handles)}-{i}",
                "pdserve.worker.main",
                worker_args(role, "127.0.0.1", self.discovery, TTL_S, self.model),
                self.workdir,
            )
            for i, role in enumerate(roles)
        ]
        self.handles.extend(started)
        return [wait_ready(w) for w in started]


@pytest.fixture(scope="module")
def cluster(
    etcd_server: EtcdHandle, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("membership")
    with processes() as handles:
        c = Cluster(etcd_server.uri("/it"), tiny_model_path, workdir, [], handles)
        c.workers = c.start_workers("prefill", "decode", "decode")
        yield c


def members_are(router: Proc, urls: set[str]) -> bool:
    current = pool(router.url)
    return set(current) == urls and all(current.values())


def test_router_builds_its_pool_from_etcd_and_serves_disaggregated(cluster: Cluster) -> None:
    router = cluster.start_router("router-a")
    expected = {w.url for w in cluster.workers}
    wait_until("router sees the three workers, healthy", lambda: members_are(router, expected), 10)
    status, body = complete(router.url)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 6  # type: ignore[index]
    router.stop()


def test_dead_worker_leaves_within_ttl_stopped_worker_at_once(cluster: Cluster) -> None:
    router = cluster.start_router("router-b")
    doomed, leaving = cluster.start_workers("decode", "decode")
    everyone = {w.url for w in (*cluster.workers, doomed, leaving)}
    wait_until("router sees the new workers", lambda: members_are(router, everyone), 10)

    doomed.kill()  # SIGKILL: no revoke, only the lapsing lease tells etcd
    statuses: list[int] = []

    def gone_while_serving() -> bool:
        statuses.append(complete(router.url, max_tokens=2)[0])
        return doomed.url not in pool(router.url)

    took = wait_until("the killed worker leaves the pool", gone_while_serving, TTL_S + SLACK_S)
    assert statuses and set(statuses) == {200}, statuses
    assert took <= TTL_S + SLACK_S

    leaving.terminate()  # SIGTERM: the worker revokes its lease before it stops serving
    took = wait_until("the stopped worker leaves", lambda: leaving.url not in pool(router.url), 5)
    assert leaving.proc.wait(10) == 0
    assert took < TTL_S, f"a revoked lease should leave at once, took {took:.2f} s"
    assert set(pool(router.url)) == {w.url for w in cluster.workers}
    assert complete(router.url)[0] == 200
    router.stop()


def test_restarted_router_rebuilds_its_pool(cluster: Cluster) -> None:
    first = cluster.start_router("router-c1")
    expected = {w.url for w in cluster.workers}
    wait_until("first router sees the workers", lambda: members_are(first, expected), 10)
    assert first.stop() == 0
    second = cluster.start_router("router-c2")
    # Nothing is carried over but etcd: the listing at start is the whole pool at once.
    assert set(pool(second.url)) == expected
    wait_until("second router's workers healthy", lambda: members_are(second, expected), 10)
    assert complete(second.url)[0] == 200
    second.stop()


def test_client_retrying_on_another_router_is_served(cluster: Cluster) -> None:
    a, b = cluster.start_router("router-d1"), cluster.start_router("router-d2")
    expected = {w.url for w in cluster.workers}
    for router in (a, b):
        wait_until(f"{router.name} sees the workers", lambda r=router: members_are(r, expected), 10)  # type: ignore[misc]
    assert complete(a.url)[0] == 200
    a.kill()
    served_by, (status, body) = complete_on_any([a.url, b.url])
    assert (served_by, status) == (b.url, 200), body
    b.stop()


def complete_on_any(router_urls: list[str]) -> tuple[str, tuple[int, dict[str, object]]]:
    """What a client with several router addresses does: the next one on a connection error."""
    errors: list[str] = []
    for url in router_urls:
        try:
            return url, complete(url)
        except OSError as exc:
            errors.append(f"{url}: {exc}")
    raise AssertionError(f"no router answered: {errors}")


def test_membership_survives_an_etcd_restart(tmp_path: Path) -> None:
    """The watch breaks when etcd dies; the router re-lists after it is back, and a worker's
    keep-alive goes on with the same lease (etcd keeps leases across a restart)."""
    from pdserve.membership import Member
    from pdserve.membership.etcd import EtcdMembership, EtcdRegistration
    from pdserve.membership.uri import parse_discovery

    port, peer_port = free_port(), free_port()
    server = start_etcd(tmp_path, port=port, peer_port=peer_port)

    async def scenario() -> None:
        nonlocal server
        endpoint = parse_discovery(server.uri("/restart"))
        seen: list[list[str]] = []
        membership = EtcdMembership(endpoint, retry_interval_s=0.2)
        await membership.start(lambda ms: seen.append([m.url for m in ms]))
        first = EtcdRegistration(endpoint, Member("http://a:1", "a", "decode", "d", "a:2"), 5)
        await first.start()
        await wait_async(lambda: membership.members() != [], 5)
        server.kill_for_test()
        server = start_etcd(tmp_path, port=port, peer_port=peer_port)
        second = EtcdRegistration(endpoint, Member("http://b:1", "b", "prefill", "d"), 5)
        await second.start()
        await wait_async(lambda: len(membership.members()) == 2, 10)
        assert [m.url for m in membership.members()] == ["http://a:1", "http://b:1"]
        await first.stop()
        await second.stop()
        await wait_async(lambda: membership.members() == [], 5)
        await membership.stop()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 40))
    finally:
        server.stop()


def test_a_registration_not_signed_by_the_cluster_is_ignored_and_counted(tmp_path: Path) -> None:
    """Write access to etcd is not membership (issue 31 D4): a router with the cluster's key
    takes only records carrying its MAC."""
    from pdserve.membership import Member
    from pdserve.membership.etcd import EtcdMembership, EtcdRegistration
    from pdserve.membership.uri import parse_discovery

    server = start_etcd(tmp_path, port=free_port(), peer_port=free_port())
    key = b"k" * 32

    async def scenario() -> None:
        endpoint = parse_discovery(server.uri("/signed"))
        membership = EtcdMembership(endpoint, retry_interval_s=0.2, key=key)
        await membership.start(lambda ms: None)
        honest = EtcdRegistration(endpoint, Member("http://a:1", "a", "decode", "d"), 5, key=key)
        forged = EtcdRegistration(endpoint, Member("http://evil:1", "evil", "decode", "d"), 5)
        other = EtcdRegistration(
            endpoint, Member("http://b:1", "b", "decode", "d"), 5, key=b"x" * 32
        )
        for registration in (honest, forged, other):
            await registration.start()
        await wait_async(lambda: membership.num_refused >= 2, 5)
        await wait_async(lambda: membership.members() != [], 5)
        assert [m.url for m in membership.members()] == ["http://a:1"]
        for registration in (honest, forged, other):
            await registration.stop()
        await membership.stop()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        server.stop()


async def wait_async(check: Callable[[], bool], timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.05)


def test_no_etcd_still_starts_a_worker_unregistered(tiny_model_path: Path, tmp_path: Path) -> None:
    """etcd down is not a reason to refuse local work: the worker starts, warns, keeps trying."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"etcd://127.0.0.1:{s.getsockname()[1]}/x"  # bound, never listening: refused
    with processes() as handles:
        worker = spawn("lonely", "pdserve.worker.main",
                       worker_args("decode", "127.0.0.1", dead, TTL_S, tiny_model_path), tmp_path)  # fmt: skip
        handles.append(worker)
        wait_ready(worker)
        assert "not registered in etcd://127.0.0.1" in worker.log()
