"""Real worker processes on loopback, driven over HTTP only: health per role, colocated
/generate equal to the offline LLM, the whole disaggregated path across two processes (equal
to colocated for greedy and seeded sampling, with no block left pinned), reservation expiry,
KV that never arrives, capacity refusals, client disconnects, and typed errors."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from cluster_auth import SignedSession, signed_reservation, signed_session
from worker_proc import WorkerHandle, launch_worker, wait_ready, worker_processes

from pdserve import LLM
from pdserve.protocol.sampling import SamplingParams

T = TypeVar("T")
TIMEOUT = aiohttp.ClientTimeout(total=20)
GREEDY = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
SEEDED = {"max_tokens": 10, "temperature": 0.8, "top_p": 0.95, "seed": 7, "ignore_eos": True}


@dataclass(frozen=True, slots=True)
class Workers:
    prefill: WorkerHandle
    decode: WorkerHandle
    both: WorkerHandle


@pytest.fixture(scope="module")
def workers(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    workdir = tmp_path_factory.mktemp("workers")
    with worker_processes() as handles:
        # Launch all three first: they load the model in parallel.
        for role in ("prefill", "decode", "both"):
            handles.append(launch_worker(role, workdir, model=tiny_model_path))
        for handle in handles:
            wait_ready(handle)
        yield Workers(*handles)
        for handle in handles:
            handle.terminate()
        for handle in handles:
            assert handle.stop() == 0, handle.log()  # SIGTERM is a graceful exit


@pytest.fixture(scope="module")
def llm(tiny_model_path: Path) -> LLM:
    return LLM(model=str(tiny_model_path))


def run(body: Callable[[SignedSession], Awaitable[T]]) -> T:
    async def main() -> T:
        async with signed_session(TIMEOUT) as session:
            return await body(session)

    return asyncio.run(main())


async def post(session: SignedSession, url: str, body: object) -> tuple[int, Any]:
    async with session.post(url, json=body) as response:
        return response.status, await response.json()


async def stream(session: SignedSession, url: str, body: object) -> list[dict[str, Any]]:
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        return [json.loads(line) async for line in response.content if line.strip()]


async def health(session: SignedSession, worker: WorkerHandle) -> dict[str, Any]:
    async with session.get(f"{worker.url}/health") as response:
        assert response.status == 200
        data: dict[str, Any] = await response.json()
        return data


async def until_idle(session: SignedSession, *workers: WorkerHandle) -> None:
    """Poll health until every worker has no pinned block, all blocks free, no lease."""
    for _ in range(100):
        states = [await health(session, w) for w in workers]
        if all(
            (s["num_pinned_blocks"], s["num_active_leases"], s["num_running"]) == (0, 0, 0)
            and s["num_free_blocks"] == s["num_blocks"]
            for s in states
        ):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"workers not idle: {states}")


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2048) for _ in range(n)]


def colocated(llm: LLM, prompt: list[int], sampling: dict[str, Any]) -> list[int]:
    (out,) = llm.generate([prompt], SamplingParams(**sampling))
    return out.token_ids


def test_health_of_each_role(workers: Workers) -> None:
    async def body(session: SignedSession) -> None:
        for worker in (workers.prefill, workers.decode, workers.both):
            h = await health(session, worker)
            assert (h["role"], h["pid"]) == (worker.role, worker.pid)
            assert (h["transfer_address"] is None) == (worker.role == "prefill")
            assert h["fingerprint_digest"] == workers.prefill.health["fingerprint_digest"]
        async with session.get(f"{workers.decode.url}/metrics") as response:
            assert "pdserve_worker_blocks_pinned{" in await response.text()

    run(body)


def test_colocated_generate_equals_offline_llm(workers: Workers, llm: LLM) -> None:
    prompt = prompt_of(40, 1)
    body = {"request_id": "gen-1", "prompt_token_ids": prompt, "sampling": GREEDY}
    events = run(lambda s: stream(s, f"{workers.both.url}/generate", body))
    assert [t for e in events for t in e["token_ids"]] == colocated(llm, prompt, GREEDY)
    assert [e["finished"] for e in events][-1] and events[-1]["finish_reason"] == "length"


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_decode_worker_recomputes_a_resumed_request_locally(
    workers: Workers, llm: LLM, sampling: dict[str, Any]
) -> None:
    # The router's local-prefill and migration step: a decode-role worker gets the prompt and
    # the tokens the client already has, and continues with exactly the next ones.
    prompt = prompt_of(40, 3)
    reference = colocated(llm, prompt, sampling)
    body = {
        "request_id": f"resume-{sampling.get('seed')}",
        "prompt_token_ids": prompt,
        "sampling": sampling,
        "output_token_ids": reference[:3],
    }
    events = run(lambda s: stream(s, f"{workers.decode.url}/generate", body))
    assert reference[:3] + [t for e in events for t in e["token_ids"]] == reference


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_disaggregated_across_two_processes_equals_colocated(
    workers: Workers, llm: LLM, sampling: dict[str, Any]
) -> None:
    prompt = prompt_of(75, 2)
    rid = f"pd-{sampling['temperature']}"

    async def body(session: SignedSession) -> list[int]:
        request = {"request_id": rid, "prompt_token_ids": prompt, "sampling": sampling}
        status, reservation = await post(session, f"{workers.decode.url}/reserve", request)
        assert status == 200, reservation
        tcp = next(e for e in reservation["endpoints"] if e["transport"] == "tcp")
        assert tcp["address"] == workers.decode.health["transfer_address"]
        signed = signed_reservation(reservation, workers.decode.url)
        status, result = await post(
            session, f"{workers.prefill.url}/prefill", {**request, "reservation": signed}
        )
        assert status == 200, result
        assert result["num_prompt_tokens"] == 75
        decode = {"request_id": rid, "first_token_id": result["first_token_id"]}
        events = await stream(session, f"{workers.decode.url}/decode", decode)
        assert events[-1]["finished"] and events[-1]["finish_reason"] == "length"
        await until_idle(session, workers.prefill, workers.decode)
        return [result["first_token_id"]] + [t for e in events for t in e["token_ids"]]

    assert run(body) == colocated(llm, prompt, sampling)


def test_reservation_whose_kv_never_arrives_expires_and_frees_blocks(workers: Workers) -> None:
    async def body(session: SignedSession) -> None:
        request = {
            "request_id": "lost",
            "prompt_token_ids": prompt_of(50, 3),
            "sampling": GREEDY,
            "lease_ttl_s": 1.0,
        }
        status, _ = await post(session, f"{workers.decode.url}/reserve", request)
        assert status == 200
        h = await health(session, workers.decode)
        assert (h["num_pinned_blocks"], h["num_active_leases"]) == (4, 1)  # ceil(51 / 16)
        await asyncio.sleep(1.0)
        await until_idle(session, workers.decode)
        decode = {"request_id": "lost", "first_token_id": 5}
        status, error = await post(session, f"{workers.decode.url}/decode", decode)
        assert (status, error["type"]) == (404, "RequestNotFound")

    run(body)


def test_decode_without_kv_reports_an_error_event_and_frees_the_reservation(
    workers: Workers,
) -> None:
    async def body(session: SignedSession) -> None:
        request = {"request_id": "slow", "prompt_token_ids": prompt_of(20, 4), "sampling": GREEDY}
        status, _ = await post(session, f"{workers.decode.url}/reserve", request)
        assert status == 200
        decode = {"request_id": "slow", "first_token_id": 5, "kv_timeout_s": 0.3}
        events = await stream(session, f"{workers.decode.url}/decode", decode)
        assert len(events) == 1
        assert (events[0]["finished"], events[0]["finish_reason"]) == (True, "error")
        assert "not verified within 0.3s" in events[0]["error"]
        await until_idle(session, workers.decode)

    run(body)


def test_full_decode_worker_answers_503_and_release_frees(workers: Workers) -> None:
    async def body(session: SignedSession) -> None:
        sampling = {"max_tokens": 16, "temperature": 0.0}
        statuses = []
        for i in range(33):  # 126 blocks each (2000 prompt tokens + 1): 32 fit in 4096
            request = {"request_id": f"fill-{i}", "prompt_token_ids": prompt_of(2000, 100 + i)}
            async with session.post(
                f"{workers.decode.url}/reserve", json={**request, "sampling": sampling}
            ) as response:
                statuses.append(response.status)
                if response.status == 503:
                    assert response.headers["Retry-After"] == "1"
                    error = await response.json()
                    assert (error["type"], error["retryable"]) == ("NoFreeBlocks", True)
        assert statuses == [200] * 32 + [503]
        for i in range(32):
            status, result = await post(
                session, f"{workers.decode.url}/release", {"request_id": f"fill-{i}"}
            )
            assert (status, result["num_freed_blocks"]) == (200, 126)
        await until_idle(session, workers.decode)

    run(body)


def test_client_disconnect_mid_stream_aborts_the_request(workers: Workers) -> None:
    async def body(session: SignedSession) -> None:
        long = {"max_tokens": 1000, "temperature": 0.0, "ignore_eos": True}
        request = {"request_id": "gone", "prompt_token_ids": prompt_of(30, 5), "sampling": long}
        async with session.post(f"{workers.both.url}/generate", json=request) as response:
            await response.content.readline()  # one token, then hang up
            response.close()
        await until_idle(session, workers.both)
        # Idle because it was aborted, not because 1000 tokens ran out: the worker's own
        # timeline says so (its `aborted` event may land just after the engine went idle),
        # and has no `finished`.
        events: list[str] = []
        deadline = asyncio.get_running_loop().time() + 10
        while "aborted" not in events:
            assert asyncio.get_running_loop().time() < deadline, events
            async with session.get(f"{workers.both.url}/debug/requests/gone") as response:
                events = [e["event"] for e in (await response.json())["events"]]
            await asyncio.sleep(0.02)
        assert "finished" not in events, events

    run(body)


def test_bad_bodies_are_400_naming_the_field(workers: Workers) -> None:
    async def body(session: SignedSession) -> None:
        url = f"{workers.both.url}/generate"
        base = {"request_id": "bad", "prompt_token_ids": [5, 6]}
        cases = [
            ({**base, "sampling": {"temperature": "hot"}}, "sampling.temperature"),
            ({**base, "sampling": {"max_tokens": 0}}, "max_tokens"),
            ({**base, "sampling": {}, "colour": 1}, "colour"),
            ({"request_id": "bad", "sampling": {}}, "prompt_token_ids"),
            ({**base, "prompt_token_ids": [], "sampling": {}}, "empty"),
            ({**base, "sampling": {}, "deadline_s": 1e300}, "deadline_s"),
        ]
        for request, field in cases:
            status, error = await post(session, url, request)
            assert status == 400, (request, error)
            assert field in error["error"], (field, error)
        reservation = {
            "request_id": "r",
            "transfer_id": "zz",
            "capability_token": "00" * 16,
            "endpoints": [{"transport": "tcp", "address": "127.0.0.1:1"}],
            "lease_epoch": 1,
            "num_cached_tokens": 0,
            "lease_ttl_s": 1.0,
        }
        # A lease that would never expire pins its blocks for good: refused, nothing held.
        forever = {**base, "sampling": {}, "lease_ttl_s": 1e300}
        status, error = await post(session, f"{workers.decode.url}/reserve", forever)
        assert (status, "lease_ttl_s" in error["error"]) == (400, True), error
        prefill = {**base, "sampling": {}, "reservation": signed_reservation(reservation)}
        status, error = await post(session, f"{workers.prefill.url}/prefill", prefill)
        assert (status, "reservation.transfer_id" in error["error"]) == (400, True)
        # Each bad field of a reservation is named, and nothing is prefilled for it.
        for change, field in (
            ({"transfer_id": "00" * 16, "endpoints": [{"transport": "rdma", "address": "h:1"}]},
             "endpoints.0.transport"),
            ({"transfer_id": "00" * 16, "endpoints": [{"transport": "tcp", "address": "nope"}]},
             "reservation.endpoints[0].address"),
            ({"transfer_id": "00" * 16, "endpoints": []}, "endpoints"),
            ({"transfer_id": "00" * 16, "num_cached_tokens": 3},
             "reservation.num_cached_tokens: 3 exceeds the prompt's 2 tokens"),
        ):  # fmt: skip
            bad = {**reservation, **change}
            body_ = {**base, "sampling": {}, "reservation": {"reservation": bad,
                     "expires_at_s": 1e12, "signature": "x"}}  # fmt: skip
            if field.startswith("reservation."):
                body_["reservation"] = signed_reservation(bad)
            status, error = await post(session, f"{workers.prefill.url}/prefill", body_)
            assert (status, field in error["error"]) == (400, True), error
        await until_idle(session, workers.both, workers.prefill)

    run(body)


def test_wrong_role_is_409(workers: Workers) -> None:
    async def body(session: SignedSession) -> None:
        request = {"request_id": "w", "prompt_token_ids": [5, 6], "sampling": {}}
        cases = [
            (workers.decode, "/prefill", request),
            (workers.prefill, "/reserve", request),
            (workers.prefill, "/decode", {"request_id": "w", "first_token_id": 1}),
            (workers.prefill, "/generate", request),
        ]
        for worker, path, payload in cases:
            status, error = await post(session, f"{worker.url}{path}", payload)
            assert (status, error["type"]) == (409, "WrongRole"), (worker.role, path)
            assert path in error["error"]

    run(body)
