"""Transport attestation in the router: which pairs are probed, the verdicts, what placement
does with a slow pair, and what the breaker is told. No sockets: a fake pool and client."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from test_router_policy import view

from pdserve.errors import WorkerCallError, WorkerUnreachable
from pdserve.protocol.worker_api import (
    ErrorBody,
    KVEndpoint,
    ProbeExpectRequest,
    ProbeResult,
    ProbeSendRequest,
    Reservation,
)
from pdserve.router.placement.affinity import AffinityPolicy, RouteQuery
from pdserve.router.placement.policy import WorkerView
from pdserve.router.workers.pair_probes import (
    PairProbe,
    PairProber,
    Verdict,
    pair_key,
    pairs_due,
    verdict_of,
)

MIB = 1 << 20


def restarted(v: WorkerView, instance: str) -> WorkerView:
    assert v.health is not None
    return dataclasses.replace(v, health=v.health.model_copy(update={"instance_id": instance}))


def test_pairs_are_prefill_by_decode_candidate_within_a_fingerprint_group() -> None:
    views = [
        view(0, "prefill"),
        view(1, "prefill", digest="B"),
        view(2, "decode"),
        view(3, "decode", healthy=False),
        view(4, "both"),
        view(5, "decode", digest="B"),
    ]
    due = [(p.url, d.url) for p, d in pairs_due(views, lambda key: False)]
    assert due == [
        ("http://w0", "http://w2"),
        ("http://w0", "http://w4"),
        ("http://w1", "http://w5"),
    ]
    # Only `both` workers (colocated): nothing would hand KV over, nothing is probed.
    assert pairs_due([view(0, "both"), view(1, "both")], lambda key: False) == []


def test_a_probed_pair_is_due_again_only_as_new_processes() -> None:
    p, d = view(0, "prefill"), view(1, "decode")
    probed = {pair_key(p, d)}
    assert pairs_due([p, d], probed.__contains__) == []
    again = pairs_due([p, restarted(d, "second-life")], probed.__contains__)
    assert [(a.url, b.url) for a, b in again] == [("http://w0", "http://w1")]


def test_a_draining_worker_forms_no_new_pair() -> None:
    p, d = view(0, "prefill"), view(1, "decode")
    assert d.health is not None
    leaving = dataclasses.replace(d, health=d.health.model_copy(update={"draining": True}))
    assert pairs_due([p, leaving], lambda key: False) == []


@pytest.mark.parametrize(
    ("transport", "num_bytes", "seconds", "verdict"),
    [
        ("tcp", 32 * MIB, 0.02, Verdict.OK),  # 1.7 GB/s
        ("tcp", 32 * MIB, 0.5, Verdict.SLOW),  # 0.07 GB/s: under 10% of 2
        ("nixl", 32 * MIB, 0.1, Verdict.SLOW),  # 0.34 GB/s: under 10% of 4
        ("tcp", 1 * MIB, 10.0, Verdict.OK),  # too small to judge a link by
    ],
)
def test_verdicts_hold_each_transport_to_its_own_rate(
    transport: str, num_bytes: int, seconds: float, verdict: Verdict
) -> None:
    got, detail = verdict_of(transport, num_bytes, seconds)
    assert got is verdict
    assert ("expected" in detail) == (verdict is Verdict.SLOW)


class FakePool:
    def __init__(self, views: list[WorkerView]) -> None:
        self.views = views

    def snapshot(self) -> list[WorkerView]:
        return self.views


class FakeClient:
    """Decode workers reserve; prefill workers 'send' at the rate given per prefill URL."""

    def __init__(self, gbps: dict[str, float], broken: set[str] | None = None) -> None:
        self.gbps = gbps
        self.broken = broken or set()
        self.sends: list[tuple[str, str]] = []

    async def probe_expect(self, url: str, request: ProbeExpectRequest) -> Reservation:
        endpoint = KVEndpoint(transport="tcp", address="127.0.0.1:1")
        return Reservation(
            request_id="probe-1", transfer_id="00" * 16, capability_token="11" * 16,
            endpoints=[endpoint], lease_epoch=0, num_cached_tokens=0, lease_ttl_s=request.ttl_s,
        )  # fmt: skip

    async def probe_send(self, url: str, request: ProbeSendRequest) -> ProbeResult:
        assert request.reservation.decode_url is not None
        self.sends.append((url, request.reservation.decode_url))
        if url in self.broken:
            raise WorkerUnreachable(url, "POST /kv_probe/send: connection refused")
        seconds = request.num_bytes / (self.gbps[url] * 1e9)
        return ProbeResult(transport="tcp", num_bytes=request.num_bytes, seconds=seconds)


def prober(
    views: list[WorkerView], client: FakeClient, verdicts: list[PairProbe], now: list[float]
) -> PairProber:
    return PairProber(
        FakePool(views),  # type: ignore[arg-type]
        client,  # type: ignore[arg-type]
        num_bytes=32 * MIB,
        reservation_key=b"k" * 32,
        on_verdict=verdicts.append,
        clock=lambda: now[0],
    )


def test_each_pair_is_probed_twice_once_and_a_slow_one_avoided() -> None:
    views = [view(0, "prefill"), view(1, "prefill"), view(2, "decode")]
    client = FakeClient({"http://w0": 3.0, "http://w1": 0.05})
    verdicts: list[PairProbe] = []
    p = prober(views, client, verdicts, [0.0])

    async def body() -> None:
        await p.probe_due()
        await p.probe_due()  # nothing new: nothing sent

    asyncio.run(body())
    # Two sends per pair (the first warms the path), and no more on the second pass.
    assert client.sends == [("http://w0", "http://w2")] * 2 + [("http://w1", "http://w2")] * 2
    assert [(v.prefill, v.verdict) for v in verdicts] == [
        ("http://w0", Verdict.OK),
        ("http://w1", Verdict.SLOW),
    ]
    assert p.avoid("http://w2") == {"http://w1"}
    assert [round(v.gbps, 2) for v in p.table()] == [3.0, 0.05]


def test_a_failed_probe_is_avoided_and_taken_again_later() -> None:
    views = [view(0, "prefill"), view(1, "decode")]
    client = FakeClient({"http://w0": 3.0}, broken={"http://w0"})
    verdicts: list[PairProbe] = []
    now = [100.0]
    p = prober(views, client, verdicts, now)
    asyncio.run(p.probe_due())
    assert verdicts[-1].verdict is Verdict.FAILED and "refused" in verdicts[-1].detail
    assert p.avoid("http://w1") == {"http://w0"}
    now[0] += 5.0
    assert asyncio.run(p.probe_due()) == []  # not yet
    client.broken = set()
    now[0] += 6.0
    again = asyncio.run(p.probe_due())
    assert [v.verdict for v in again] == [Verdict.OK]
    assert p.avoid("http://w1") == set() and len(p.table()) == 1


def test_placement_prefers_another_prefill_but_never_refuses_for_a_slow_pair() -> None:
    policy = AffinityPolicy()
    slow, fast, decode = view(0, "prefill"), view(1, "prefill", running=5), view(2, "decode")
    query = RouteQuery(prompt_token_ids=list(range(40)), max_tokens=8)
    # By load alone the idle `slow` worker would be chosen.
    assert policy.pick_prefill([slow, fast, decode], decode, query) == slow
    policy.avoid_pairs = lambda url: {slow.url} if url == decode.url else set()
    assert policy.pick_prefill([slow, fast, decode], decode, query) == fast
    # The only prefill worker left is the slow pair's: it serves.
    assert policy.pick_prefill([slow, decode], decode, query) == slow
    assert policy.pick_prefill([slow, fast, decode], decode, query, exclude={fast.url}) == slow


def test_a_worker_that_serves_no_probe_is_used_unprobed() -> None:
    """An older build answers 404: not a broken path, so nothing is steered or counted."""

    class OldBuild(FakeClient):
        async def probe_send(self, url: str, request: ProbeSendRequest) -> ProbeResult:
            raise WorkerCallError(url, 404, ErrorBody(error="Not Found", type="HTTPError"))

    views = [view(0, "prefill"), view(1, "decode")]
    verdicts: list[PairProbe] = []
    p = prober(views, OldBuild({}), verdicts, [0.0])
    asyncio.run(p.probe_due())
    assert [v.verdict for v in verdicts] == [Verdict.UNSUPPORTED]
    assert p.avoid("http://w1") == set()
    assert asyncio.run(p.probe_due()) == []  # settled: not asked again
