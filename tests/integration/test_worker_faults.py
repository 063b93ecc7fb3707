"""Fault injection in real worker processes: `--fault` at start and `/admin/faults` at run time.

A crash at `worker.prefill_reply` kills the process (SIGKILL) before it answers; a corrupted KV
send and a dropped KV connection are caught by the receiver and retried, so the tokens equal a
run without faults; an injected close cuts a decode stream after N tokens and frees the
reservation; without `--enable-fault-admin` the admin routes do not exist; a bad spec exits 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from cluster_auth import SignedSession, signed_model, signed_session
from worker_proc import WorkerHandle, launch_worker, wait_ready, worker_processes

from pdserve.faults import parse_rule
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker_api import (
    DecodeRequest,
    KVAbortRequest,
    PrefillRequest,
    PrefillResult,
    RenewRequest,
    Reservation,
    ReserveRequest,
    TokenEvent,
)
from pdserve.protocol.worker_observe import FaultPlanBody, FaultState

T = TypeVar("T")
TIMEOUT = aiohttp.ClientTimeout(total=20)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ADMIN = ["--enable-fault-admin"]


@dataclass(frozen=True, slots=True)
class Workers:
    prefill: WorkerHandle  # --enable-fault-admin
    decode: WorkerHandle  # --enable-fault-admin
    crashing: WorkerHandle  # --fault worker.prefill_reply:crash, no admin routes
    crashing_sender: WorkerHandle  # --fault transfer.send:crash:after=2 (mid-transfer)


@pytest.fixture(scope="module")
def workers(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    workdir = tmp_path_factory.mktemp("fault-workers")
    with worker_processes() as handles:
        # Launch all first: they load the model in parallel.
        handles.append(launch_worker("prefill", workdir, model=tiny_model_path, extra_args=ADMIN))
        handles.append(launch_worker("decode", workdir, model=tiny_model_path, extra_args=ADMIN))
        crash = ["--fault", "worker.prefill_reply:crash", "--fault-seed", "3"]
        handles.append(launch_worker("prefill", workdir, model=tiny_model_path, extra_args=crash))
        crash = ["--fault", "transfer.send:crash:after=2"]
        handles.append(launch_worker("prefill", workdir, model=tiny_model_path, extra_args=crash))
        for handle in handles:
            wait_ready(handle)
        yield Workers(*handles)
        for handle in handles[:2]:  # whatever was injected, they still stop gracefully
            assert handle.stop() == 0, handle.log()


def run(body: Callable[[SignedSession], Awaitable[T]]) -> T:
    async def main() -> T:
        async with signed_session(TIMEOUT) as session:
            return await body(session)

    return asyncio.run(main())


async def post(session: SignedSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, data=body.model_dump_json()) as response:
        if response.content_type != "application/json":
            return response.status, await response.text()  # aiohttp's own 404 is plain text
        return response.status, await response.json()


async def set_faults(session: SignedSession, worker: WorkerHandle, *rules: str) -> None:
    plan = FaultPlanBody(rules=list(rules))
    status, state = await post(session, f"{worker.url}/admin/faults", plan)
    assert status == 200, state
    # The worker reports each rule in its canonical spelling.
    assert FaultState.model_validate(state).rules == [parse_rule(r).spec() for r in rules]


async def faults_of(session: SignedSession, worker: WorkerHandle) -> FaultState:
    async with session.get(f"{worker.url}/admin/faults") as response:
        assert response.status == 200
        return FaultState.model_validate(await response.json())


async def read_events(response: aiohttp.ClientResponse) -> tuple[list[TokenEvent], bool]:
    """The stream's events, and whether it ended cleanly (False: the connection was cut)."""
    events = []
    try:
        async for line in response.content:
            if line.strip():
                events.append(TokenEvent.model_validate_json(line))
    except aiohttp.ClientPayloadError:
        return events, False
    return events, True


async def disaggregated(
    session: SignedSession, w: Workers, request_id: str
) -> tuple[list[int], bool]:
    """reserve on decode -> prefill -> decode; (every token, whether the stream ended cleanly)."""
    prompt = [random.Random(5).randrange(3, 2048) for _ in range(40)]
    reserve = ReserveRequest(request_id=request_id, prompt_token_ids=prompt, sampling=GREEDY)
    status, body = await post(session, f"{w.decode.url}/reserve", reserve)
    assert status == 200, body
    prefill = PrefillRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=GREEDY,
        reservation=signed_model(Reservation.model_validate(body), w.decode.url),
    )
    status, body = await post(session, f"{w.prefill.url}/prefill", prefill)
    assert status == 200, body
    first = PrefillResult.model_validate(body).first_token_id
    decode = DecodeRequest(request_id=request_id, first_token_id=first)
    async with session.post(f"{w.decode.url}/decode", data=decode.model_dump_json()) as response:
        assert response.status == 200
        events, clean = await read_events(response)
    return [first] + [t for e in events for t in e.token_ids], clean


async def until_idle(session: SignedSession, *workers: WorkerHandle) -> None:
    """Poll health until no worker holds a pinned block, a lease or a running request."""
    for _ in range(100):
        states = []
        for worker in workers:
            async with session.get(f"{worker.url}/health") as response:
                states.append(await response.json())
        if all(
            (s["num_pinned_blocks"], s["num_active_leases"], s["num_running"]) == (0, 0, 0)
            and s["num_free_blocks"] == s["num_blocks"]
            for s in states
        ):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"workers not idle: {states}")


@pytest.fixture(scope="module")
def reference(workers: Workers) -> list[int]:
    """The tokens of the disaggregated request with no fault."""

    async def body(session: SignedSession) -> list[int]:
        tokens, clean = await disaggregated(session, workers, "reference")
        assert clean and len(tokens) == GREEDY.max_tokens
        return tokens

    return run(body)


def test_without_the_admin_flag_the_admin_routes_do_not_exist(workers: Workers) -> None:
    async def body(session: SignedSession) -> None:
        url = f"{workers.crashing.url}/admin/faults"
        status, _ = await post(session, url, FaultPlanBody(rules=[]))
        assert status == 404
        async with session.get(url) as response:
            assert response.status == 404

    run(body)


def test_a_crash_before_the_prefill_reply_kills_the_process(workers: Workers) -> None:
    request = PrefillRequest(request_id="doomed", prompt_token_ids=[5, 6, 7], sampling=GREEDY)

    async def body(session: SignedSession) -> None:
        with pytest.raises(aiohttp.ClientConnectionError):
            await post(session, f"{workers.crashing.url}/prefill", request)

    run(body)
    assert workers.crashing.proc.wait(10) == -9  # SIGKILL: it died at once
    assert "fault crash: killing process" in workers.crashing.log()


def test_a_crash_mid_transfer_kills_the_sender_and_the_reservation_is_freed(
    workers: Workers,
) -> None:
    prompt = list(range(10, 50))
    reserve = ReserveRequest(request_id="orphan", prompt_token_ids=prompt, sampling=GREEDY)

    async def body(session: SignedSession) -> list[TokenEvent]:
        status, reservation = await post(session, f"{workers.decode.url}/reserve", reserve)
        assert status == 200, reservation
        prefill = PrefillRequest(
            request_id="orphan",
            prompt_token_ids=prompt,
            sampling=GREEDY,
            reservation=signed_model(Reservation.model_validate(reservation)),
        )
        # The send runs beside the reply: the process may die before or after answering.
        with contextlib.suppress(aiohttp.ClientConnectionError):
            await post(session, f"{workers.crashing_sender.url}/prefill", prefill)
        await asyncio.to_thread(workers.crashing_sender.proc.wait, 10)
        decode = DecodeRequest(request_id="orphan", first_token_id=1, kv_timeout_s=0.5)
        url = f"{workers.decode.url}/decode"
        async with session.post(url, data=decode.model_dump_json()) as response:
            events, clean = await read_events(response)
        assert clean
        await until_idle(session, workers.decode)
        return events

    events = run(body)
    assert workers.crashing_sender.proc.returncode == -9
    assert [(e.finished, e.finish_reason) for e in events] == [(True, "error")]
    assert events[0].error is not None and "KVNotReady" in events[0].error


def test_a_corrupted_kv_send_is_caught_and_resent(workers: Workers, reference: list[int]) -> None:
    async def body(session: SignedSession) -> tuple[list[int], FaultState]:
        await set_faults(session, workers.prefill, "transfer.send:corrupt:after=1")
        try:
            tokens, clean = await disaggregated(session, workers, "corrupt")
            assert clean
            await until_idle(session, workers.prefill, workers.decode)
            return tokens, await faults_of(session, workers.prefill)
        finally:
            async with session.delete(f"{workers.prefill.url}/admin/faults") as response:
                assert response.status == 200

    tokens, state = run(body)
    assert tokens == reference
    assert [(i.site, i.hit, i.action) for i in state.injected] == [("transfer.send", 1, "corrupt")]
    assert state.num_injected == 1
    assert state.hits["transfer.send"] > 4  # a second attempt went out after the damaged one


def test_a_kv_connection_dropped_at_a_chunk_is_retried(
    workers: Workers, reference: list[int]
) -> None:
    async def body(session: SignedSession) -> tuple[list[int], FaultState]:
        await set_faults(session, workers.decode, "transfer.recv_chunk:close")
        try:
            tokens, clean = await disaggregated(session, workers, "dropped")
            assert clean
            return tokens, await faults_of(session, workers.decode)
        finally:
            async with session.delete(f"{workers.decode.url}/admin/faults") as response:
                assert response.status == 200

    tokens, state = run(body)
    assert tokens == reference
    assert [(i.site, i.hit, i.action) for i in state.injected] == [
        ("transfer.recv_chunk", 0, "close")
    ]


def test_a_close_after_three_tokens_cuts_the_decode_stream(
    workers: Workers, reference: list[int]
) -> None:
    async def body(session: SignedSession) -> tuple[list[int], bool]:
        await set_faults(session, workers.decode, "worker.decode_tokens:close:after=3")
        try:
            result = await disaggregated(session, workers, "cut")
            await until_idle(session, workers.prefill, workers.decode)  # the abort freed it
            return result
        finally:
            async with session.delete(f"{workers.decode.url}/admin/faults") as response:
                assert response.status == 200

    tokens, clean = run(body)
    assert not clean
    # The first token came from the prefill; the stream carried three more before the cut.
    assert tokens == reference[:4]


def test_a_close_at_reserve_or_prefill_drops_the_call_and_the_worker_serves_on(
    workers: Workers, reference: list[int]
) -> None:
    request = ReserveRequest(request_id="closed", prompt_token_ids=[5, 6, 7], sampling=GREEDY)
    prefill = PrefillRequest.model_validate(request.model_dump())

    async def body(session: SignedSession) -> list[int]:
        await set_faults(session, workers.decode, "worker.reserve:close")
        await set_faults(session, workers.prefill, "worker.prefill:close")
        try:
            with pytest.raises(aiohttp.ClientConnectionError):
                await post(session, f"{workers.decode.url}/reserve", request)
            with pytest.raises(aiohttp.ClientConnectionError):
                await post(session, f"{workers.prefill.url}/prefill", prefill)
            await until_idle(session, workers.prefill, workers.decode)  # nothing was allocated
            tokens, clean = await disaggregated(session, workers, "after-close")  # times=1: gone
            assert clean
            return tokens
        finally:
            for worker in (workers.decode, workers.prefill):
                async with session.delete(f"{worker.url}/admin/faults") as response:
                    assert response.status == 200

    assert run(body) == reference


def test_a_delay_at_prefill_holds_the_reply(workers: Workers) -> None:
    request = PrefillRequest(request_id="slow", prompt_token_ids=[5, 6, 7], sampling=GREEDY)

    async def body(session: SignedSession) -> float:
        await set_faults(session, workers.prefill, "worker.prefill:delay:delay_s=0.3")
        try:
            loop = asyncio.get_running_loop()
            start = loop.time()
            status, result = await post(session, f"{workers.prefill.url}/prefill", request)
            assert status == 200, result
            return loop.time() - start
        finally:
            async with session.delete(f"{workers.prefill.url}/admin/faults") as response:
                assert response.status == 200

    assert run(body) >= 0.3


def test_a_bad_rule_posted_is_400_naming_it(workers: Workers) -> None:
    async def body(session: SignedSession) -> tuple[int, Any]:
        plan = FaultPlanBody(rules=["worker.prefill:delay", "worker.reserve:corrupt"])
        return await post(session, f"{workers.decode.url}/admin/faults", plan)

    status, error = run(body)
    assert status == 400
    assert error["type"] == "ConfigError"
    assert "fault rule 'worker.reserve:corrupt'" in error["error"]
    assert "allowed: delay, close, stall, crash" in error["error"]


def test_a_bad_fault_flag_exits_2_naming_it() -> None:
    args = [sys.executable, "-m", "pdserve.worker.main", "--fault", "transfer.send:melt"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "fault rule 'transfer.send:melt': unknown action 'melt'" in lines[0]


def test_admin_state_is_json_of_the_plan(workers: Workers) -> None:
    async def body(session: SignedSession) -> Any:
        await set_faults(session, workers.prefill, "worker.prefill:delay:delay_s=0.01,times=0")
        async with session.get(f"{workers.prefill.url}/admin/faults") as response:
            state = await response.json()
        async with session.delete(f"{workers.prefill.url}/admin/faults") as response:
            cleared = await response.json()
        return state, cleared

    state, cleared = run(body)
    assert state == {  # the canonical spelling: options in field order
        "rules": ["worker.prefill:delay:times=0,delay_s=0.01"],
        "seed": 0,
        "injected": [],
        "num_injected": 0,
        "hits": {},
    }
    assert cleared == {"rules": [], "seed": 0, "injected": [], "num_injected": 0, "hits": {}}


def test_a_send_given_up_fails_the_decode_at_once_not_at_lease_end(workers: Workers) -> None:
    """Every KV send closed and one attempt allowed: the prefill worker tells the decode worker
    (POST /kv_abort, authenticated by the reservation's token), whose /decode then fails with
    the reason long before the reservation's 20 s lease would have ended it."""

    async def body(session: SignedSession) -> tuple[float, list[TokenEvent]]:
        await set_faults(session, workers.prefill, "transfer.send:close:times=0")
        prompt = [random.Random(9).randrange(3, 2048) for _ in range(40)]
        reserve = ReserveRequest(
            request_id="abandoned", prompt_token_ids=prompt, sampling=GREEDY, lease_ttl_s=20
        )
        status, answer = await post(session, f"{workers.decode.url}/reserve", reserve)
        assert status == 200, answer
        reservation = Reservation.model_validate(answer)
        # A forged notice (right request, wrong token) is refused and cancels nothing.
        forged = KVAbortRequest(
            request_id="abandoned",
            transfer_id=reservation.transfer_id,
            capability_token="00" * 16,
            reason="forged",
        )
        status, answer = await post(session, f"{workers.decode.url}/kv_abort", forged)
        assert status == 403 and answer["type"] == "Unauthorized", answer
        prefill = PrefillRequest(
            request_id="abandoned",
            prompt_token_ids=prompt,
            sampling=GREEDY,
            reservation=signed_model(reservation, workers.decode.url),
            lease_ttl_s=20,
            transfer_attempts=1,
        )
        start = asyncio.get_running_loop().time()
        status, answer = await post(session, f"{workers.prefill.url}/prefill", prefill)
        assert status == 200, answer
        decode = DecodeRequest(request_id="abandoned", first_token_id=1, kv_timeout_s=20)
        async with session.post(f"{workers.decode.url}/decode", data=decode.model_dump_json()) as r:
            events, _ = await read_events(r)
        elapsed = asyncio.get_running_loop().time() - start
        await set_faults(session, workers.prefill)
        await until_idle(session, workers.prefill, workers.decode)
        return elapsed, events

    elapsed, events = run(body)
    assert events and events[-1].finish_reason == "error"
    assert "sender gave up" in (events[-1].error or ""), events[-1]
    assert elapsed < 10, f"the decode side learned after {elapsed:.1f} s (lease: 20 s)"


def test_renew_keeps_a_reservation_past_its_ttl_and_lapses_without(workers: Workers) -> None:
    async def body(session: SignedSession) -> None:
        prompt = [random.Random(11).randrange(3, 2048) for _ in range(40)]
        reserve = ReserveRequest(
            request_id="renewed", prompt_token_ids=prompt, sampling=GREEDY, lease_ttl_s=1.0
        )
        status, answer = await post(session, f"{workers.decode.url}/reserve", reserve)
        assert status == 200, answer
        renew = RenewRequest(request_id="renewed")
        for _ in range(6):  # 1.8 s in all: past the 1 s TTL, kept alive
            await asyncio.sleep(0.3)
            status, answer = await post(session, f"{workers.decode.url}/renew", renew)
            assert status == 200 and answer["lease_ttl_s"] == 1.0, answer
        # No renewal: the reaper frees it one TTL (1 s) after the last renewal. Watched on
        # /health, which renews nothing (a /renew to poll would keep it alive).
        await until_idle(session, workers.decode)
        status, answer = await post(session, f"{workers.decode.url}/renew", renew)
        assert status == 404 and answer["type"] == "RequestNotFound", answer
        await until_idle(session, workers.decode)

    run(body)
