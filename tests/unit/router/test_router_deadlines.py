"""Every request ends on time (invariant 9), whatever the workers do: a property test.

The disaggregated and colocated flows run on virtual time (`virtual_time.py`) against fake
workers whose every call does something hypothesis chose: answer, refuse (503), vanish
(connection error), hang forever, answer late, fail the KV handoff (KVNotReady, KVValueMismatch),
cut a token stream mid-way, or report the request's deadline passed. For every request:
exactly one terminal state (FINISHED or FAILED) before its deadline; if it finished, exactly the
scripted tokens, each once and in order; if it failed, a typed error whose HTTP answer is 502,
503 or 504 (never a 500); and every hold the router took on a worker (a reservation, a running
/generate) released or finished by the time the flow is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from virtual_time import run_virtual

from pdserve.errors import NoCapacity, RouterError, WorkerCallError, WorkerUnreachable
from pdserve.protocol.request_state import RequestState, RequestTimeline
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker_api import (
    DecodeRequest,
    ErrorBody,
    GenerateRequest,
    HandoffInfo,
    KVEndpoint,
    PrefillRequest,
    PrefillResult,
    RenewRequest,
    RenewResult,
    Reservation,
    ReserveRequest,
    TokenEvent,
    WorkerHealth,
)
from pdserve.router.app import error_reply
from pdserve.router.config import AffinityConfig, RecoveryConfig
from pdserve.router.flows.colocated import ColocatedFlow
from pdserve.router.flows.disagg import DisaggFlow
from pdserve.router.flows.flow import FlowRequest
from pdserve.router.placement.affinity import AffinityPolicy
from pdserve.router.placement.policy import WorkerView

MAX_TOKENS = 6
SCRIPT = [100 + i for i in range(MAX_TOKENS)]
REQUEST_TIMEOUT_S = 20.0
BEHAVIOURS = ("ok", "ok", "ok", "refuse", "unreachable", "hang", "slow", "kv_fail", "cut", "late")


def health(role: str) -> WorkerHealth:
    return WorkerHealth(
        worker_id=role,
        role=role,  # type: ignore[arg-type]
        pid=1,
        fingerprint={"a": 1},
        fingerprint_digest="fp",
        transfer_address=None,
        max_model_len=4096,
        block_size=16,
        num_blocks=100,
        num_free_blocks=100,
        num_pinned_blocks=0,
        num_running=0,
        num_waiting=0,
        num_active_leases=0,
    )


class FakePool:
    """Prefill and decode workers (two of each by default), healthy until a call fails or a
    test marks them paused (a paused worker's health poll times out: it is out of the pool)."""

    def __init__(
        self, num_prefill: int = 2, decode_role: str = "both", paused: frozenset[str] = frozenset()
    ) -> None:
        self.roles = {f"http://p{i}": "prefill" for i in range(num_prefill)}
        self.roles |= {"http://d0": decode_role, "http://d1": decode_role}
        self.failed: set[str] = set(paused)

    def snapshot(self) -> list[WorkerView]:
        return [
            WorkerView(url, i, health(role), url not in self.failed)
            for i, (url, role) in enumerate(self.roles.items())
        ]

    @contextlib.contextmanager
    def inflight(self, url: str):  # type: ignore[no-untyped-def]
        yield

    def mark_failed(self, url: str, reason: str) -> None:
        self.failed.add(url)

    def digest_of(self, url: str) -> str | None:
        return next(
            (v.health.fingerprint_digest for v in self.snapshot() if v.url == url and v.health),
            None,
        )


@dataclass
class FakeClient:
    """Worker calls that behave as hypothesis drew them, one behaviour per call, in order."""

    plan: list[str]
    holds: set[tuple[str, str]] = field(default_factory=set)
    calls: int = 0

    def _next(self) -> str:
        self.calls += 1
        return self.plan.pop(0) if self.plan else "ok"

    async def _misbehave(self, url: str, what: str, behaviour: str) -> None:
        if behaviour == "hang":
            await asyncio.sleep(1e9)
        if behaviour == "slow":
            await asyncio.sleep(3.0)
        if behaviour == "unreachable":
            raise WorkerUnreachable(url, f"{what}: connection refused")
        if behaviour == "refuse":
            body = ErrorBody(error="no free blocks", type="NoFreeBlocks", retryable=True)
            raise WorkerCallError(url, 503, body)

    async def reserve(
        self, url: str, request: ReserveRequest, remaining_s: float | None = None
    ) -> Reservation:
        await self._misbehave(url, "reserve", self._next())
        self.holds.add((url, request.request_id))
        return Reservation(
            request_id=request.request_id,
            transfer_id="00" * 16,
            capability_token="11" * 16,
            endpoints=[KVEndpoint(transport="tcp", address="127.0.0.1:1")],
            lease_epoch=1,
            num_cached_tokens=0,
            lease_ttl_s=request.lease_ttl_s,
        )

    async def prefill(
        self, url: str, request: PrefillRequest, remaining_s: float | None = None
    ) -> PrefillResult:
        behaviour = self._next()
        await self._misbehave(url, "prefill", "refuse" if behaviour == "kv_fail" else behaviour)
        return PrefillResult(
            request_id=request.request_id,
            first_token_id=SCRIPT[0],
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=0,
            prefill_start_ns=1,
            prefill_end_ns=2,
        )

    async def renew(self, url: str, request: RenewRequest) -> RenewResult:
        return RenewResult(request_id=request.request_id, lease_ttl_s=1.0)

    async def release_quietly(self, url: str, request_id: str, *more_urls: str) -> None:
        for u in (url, *more_urls):
            self.holds.discard((u, request_id))

    def release_in_background(self, url: str, request_id: str) -> None:
        self.holds.discard((url, request_id))

    async def decode(self, url: str, request: DecodeRequest) -> AsyncGenerator[TokenEvent, None]:
        behaviour = self._next()
        rid = request.request_id
        await self._misbehave(url, "decode", behaviour)
        if behaviour in ("kv_fail", "late"):
            kind = "KVValueMismatch" if behaviour == "kv_fail" else "DeadlineExceeded"
            yield TokenEvent(
                token_ids=[], finished=True, finish_reason="error", error=kind, error_type=kind
            )
            self.holds.discard((url, rid))
            return
        yield TokenEvent(
            token_ids=[],
            handoff=HandoffInfo(
                transport="tcp", num_bytes=1, seconds=0.1, slow=False, canary="exact"
            ),
        )
        async for event in self._tokens(url, rid, 1, behaviour):
            yield event

    async def generate(
        self, url: str, request: GenerateRequest
    ) -> AsyncGenerator[TokenEvent, None]:
        behaviour = self._next()
        await self._misbehave(url, "generate", behaviour)
        self.holds.add((url, request.request_id))
        start = len(request.output_token_ids)
        assert request.output_token_ids == SCRIPT[:start]  # resumes after exactly what was sent
        async for event in self._tokens(url, request.request_id, start, behaviour):
            yield event

    async def _tokens(
        self, url: str, rid: str, start: int, behaviour: str
    ) -> AsyncGenerator[TokenEvent, None]:
        for i in range(start, MAX_TOKENS):
            await asyncio.sleep(0.05)
            if behaviour == "cut" and i >= start + 1:
                raise WorkerUnreachable(url, "stream cut")  # the worker died mid-stream
            last = i == MAX_TOKENS - 1
            if last:
                self.holds.discard((url, rid))
            yield TokenEvent(
                token_ids=[SCRIPT[i]], finished=last, finish_reason="length" if last else None
            )


@dataclass
class Outcome:
    tokens: list[int]
    error: BaseException | None
    timeline: RequestTimeline
    ended_at: float
    deadline: float


async def one_request(mode: str, client: FakeClient, pool: FakePool | None = None) -> Outcome:
    pool = pool or FakePool()
    affinity = AffinityPolicy(AffinityConfig(routing="load", local_prefill_threshold=0))
    recovery = RecoveryConfig(queue_timeout_s=2.0, max_reprefills=1, max_migrations=2)
    flow: DisaggFlow | ColocatedFlow
    if mode == "disagg":
        flow = DisaggFlow(pool, client, [2], recovery=recovery, lease_ttl_s=1.0, affinity=affinity)  # type: ignore[arg-type]
    else:
        flow = ColocatedFlow(pool, client, affinity)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + REQUEST_TIMEOUT_S
    timeline = RequestTimeline("r1", mode)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, seed=1)
    request = FlowRequest("r1", [5, 6, 7], sampling, timeline, None, deadline)
    tokens: list[int] = []
    error: BaseException | None = None
    try:
        async with (
            asyncio.timeout_at(deadline),
            contextlib.aclosing(flow.stream(request)) as chunks,
        ):
            async for chunk in chunks:
                tokens.extend(chunk.token_ids)
    except (RouterError, TimeoutError) as exc:
        error = exc
        timeline.fail(str(exc))  # what `OpenAIApi._serve` does for a timeout
    return Outcome(tokens, error, timeline, loop.time(), deadline)


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    plan=st.lists(st.sampled_from(BEHAVIOURS), max_size=12),
    num_prefill=st.integers(0, 2),
    decode_role=st.sampled_from(["both", "decode"]),
    paused=st.frozensets(st.sampled_from(["http://p0", "http://p1", "http://d0"])),
)
def test_every_request_ends_once_on_time_never_500_and_releases_everything(
    mode: str, plan: list[str], num_prefill: int, decode_role: str, paused: frozenset[str]
) -> None:
    client = FakeClient(list(plan))
    pool = FakePool(num_prefill, decode_role, paused)
    outcome = run_virtual(one_request(mode, client, pool))
    history = outcome.timeline.history
    terminal = [t for t in history if t.state in (RequestState.FINISHED, RequestState.FAILED)]
    assert len(terminal) == 1 and history[-1] is terminal[0], [t.state for t in history]
    assert outcome.ended_at <= outcome.deadline + 1e-6
    # Tokens reached the client exactly once, in order: a prefix of the script, all of it if
    # the request finished.
    assert outcome.tokens == SCRIPT[: len(outcome.tokens)]
    if outcome.error is None:
        assert outcome.tokens == SCRIPT and terminal[0].state is RequestState.FINISHED
    else:
        reply = error_reply(outcome.error, REQUEST_TIMEOUT_S)
        assert reply.status in (502, 503, 504), (reply, outcome.error)
        assert terminal[0].state is RequestState.FAILED
        if isinstance(outcome.error, NoCapacity):
            assert reply.extra.get("retry_after")
    assert client.holds == set(), f"holds left on workers: {client.holds}"


def test_a_worker_that_hangs_forever_costs_the_request_its_deadline_not_more() -> None:
    client = FakeClient(["hang"] * 50)
    outcome = run_virtual(one_request("disagg", client))
    assert isinstance(outcome.error, TimeoutError)
    assert outcome.ended_at == pytest.approx(outcome.deadline)
    assert client.holds == set()


def test_a_paused_prefill_worker_is_a_local_prefill_not_a_500() -> None:
    # Issue 14: with every prefill worker out of the pool, the flow's first step is a local
    # prefill from RECEIVED (an illegal transition before, hence HTTP 500).
    async def body() -> Outcome:
        client = FakeClient([])
        pool = FakePool(2, "decode", frozenset({"http://p0", "http://p1"}))
        affinity = AffinityPolicy(AffinityConfig(routing="load", local_prefill_threshold=0))
        flow = DisaggFlow(pool, client, [2], affinity=affinity)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        timeline = RequestTimeline("r1", "disagg")
        sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        request = FlowRequest("r1", [5], sampling, timeline, None, loop.time() + 20)
        async with contextlib.aclosing(flow.stream(request)) as chunks:
            tokens = [t async for c in chunks for t in c.token_ids]
        return Outcome(tokens, None, timeline, loop.time(), request.deadline)

    outcome = run_virtual(body())
    assert outcome.tokens == SCRIPT
    states = [t.state for t in outcome.timeline.history]
    assert states[:3] == [RequestState.RECEIVED, RequestState.RETRYING, RequestState.ROUTED]
    assert outcome.timeline.history[1].reason is not None


def test_a_cancel_landing_in_the_disagg_cleanup_still_ends_the_request_and_wakes_the_queue() -> (
    None
):
    """The client hangs up mid-stream, and a second cancel lands while the flow releases what
    the workers hold: the request still ends FAILED and the capacity queue is still told that
    the decode blocks are free (a waiter would otherwise sleep until its own timeout)."""

    class SlowRelease(FakeClient):
        async def release_quietly(self, url: str, request_id: str, *more_urls: str) -> None:
            releasing.set()
            await asyncio.sleep(1e9)  # the release is still under way when the cancel lands

    releasing = asyncio.Event()

    async def body() -> tuple[RequestTimeline, int]:
        pool = FakePool(1, "decode")
        affinity = AffinityPolicy(AffinityConfig(routing="load", local_prefill_threshold=0))
        flow = DisaggFlow(pool, SlowRelease([]), [2], affinity=affinity)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        timeline = RequestTimeline("r1", "disagg")
        sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        request = FlowRequest("r1", [5], sampling, timeline, None, loop.time() + 20)
        first = asyncio.Event()

        async def client() -> None:
            async with contextlib.aclosing(flow.stream(request)) as chunks:
                async for _ in chunks:
                    first.set()

        task = asyncio.create_task(client())
        await first.wait()
        task.cancel()  # the client hung up
        await releasing.wait()
        task.cancel()  # and a cancel lands in the cleanup
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return timeline, flow.queue.num_notified

    timeline, notified = run_virtual(body())
    assert timeline.state is RequestState.FAILED
    assert notified == 1


def test_a_reprefill_whose_only_prefill_worker_failed_it_goes_local_at_once() -> None:
    """Its handoff failed and the one prefill worker is the one it failed on: no wait in the
    queue can give it a pair, so it is served on the decode worker now, not after the queue
    timeout (2 s here)."""

    async def body() -> tuple[Outcome, float]:
        start = asyncio.get_running_loop().time()
        outcome = await one_request(
            "disagg", FakeClient(["ok", "ok", "kv_fail"]), FakePool(1, "decode")
        )
        return outcome, outcome.ended_at - start

    outcome, took = run_virtual(body())
    assert outcome.tokens == SCRIPT and outcome.error is None
    reasons = [t.reason for t in outcome.timeline.history if t.state is RequestState.RETRYING]
    assert [r.value for r in reasons if r is not None] == ["reprefill", "local_prefill"]
    assert took < 1.0


def test_a_waiter_that_only_its_failed_prefill_worker_could_serve_does_not_hold_up_the_queue() -> (
    None
):
    """A partition: every worker is down while a reprefill (which skips the prefill worker it
    failed on) and a fresh request wait in the queue. At the heal, the head cannot use what came
    back; it leaves at once (NoCapacity: its flow goes local) and hands the wake-up on, so the
    request behind it is served at the heal, not after the head's queue timeout."""
    from pdserve.router.flows.capacity_queue import CapacityQueue
    from pdserve.router.flows.reservations import Reserver
    from pdserve.router.placement.affinity import RouteQuery

    async def body() -> tuple[BaseException | None, float, float]:
        loop = asyncio.get_running_loop()
        pool = FakePool(1, "decode", frozenset({"http://p0", "http://d0", "http://d1"}))
        queue = CapacityQueue(max_waiting=8)
        affinity = AffinityPolicy(AffinityConfig(routing="load", local_prefill_threshold=0))
        reserver = Reserver(pool, FakeClient([]), affinity, queue, lease_ttl_s=3.0,  # type: ignore[arg-type]
                            queue_timeout_s=10.0)  # fmt: skip
        sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

        def request(rid: str) -> FlowRequest:
            timeline = RequestTimeline(rid, "disagg")
            return FlowRequest(rid, [5, 6], sampling, timeline, None, loop.time() + 30)

        query = RouteQuery([5, 6], MAX_TOKENS)
        head = asyncio.create_task(reserver.reserve(request("a"), query, "a.r1", {"http://p0"}))
        await asyncio.sleep(0.1)
        behind = asyncio.create_task(reserver.reserve(request("b"), query, "b", set()))
        await asyncio.sleep(0.1)
        assert queue.num_waiting == 2
        healed = loop.time()
        pool.failed.clear()  # the heal: the health polls see every worker again
        queue.notify()
        error: BaseException | None = None
        try:
            await head
        except NoCapacity as exc:
            error = exc
        head_left = loop.time() - healed
        leg = await behind
        assert leg.prefill_url == "http://p0"
        return error, head_left, loop.time() - healed

    error, head_left, served = run_virtual(body())
    assert isinstance(error, NoCapacity) and "only prefill workers it failed on" in str(error)
    assert head_left < 0.5 and served < 0.5
