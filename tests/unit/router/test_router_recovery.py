"""The router's recovery policy against fake workers: each step, in order, within its budget.

A failed handoff (KV never verified) re-prefills on another prefill worker, else the decode
worker recomputes locally; a dead prefill side falls back to local prefill; a decode stream cut
after commit migrates; refused reservations wait in the bounded queue, never prefilling first.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fake_worker import FakeWorker
from router_harness import completion, router, run

from pdserve.clock import FakeClock
from pdserve.model.tokenizer import Tokenizer
from pdserve.observability.exposition import parse, total
from pdserve.router.config import BreakerConfig, RecoveryConfig


@pytest.fixture(scope="module")
def tokens(tiny_model_path: Path) -> list[int]:
    return Tokenizer(tiny_model_path).encode(
        " one two three four five six", add_special_tokens=False
    )


def _text(model: Path, tokens: list[int], n: int) -> str:
    return Tokenizer(model).decode(tokens[:n])


def _rid(worker: FakeWorker, path: str) -> str:
    return next(r for p, r in worker.calls if p == path)


def test_failed_handoff_reprefills_on_another_prefill_worker(
    tiny_model_path: Path, tokens: list[int]
) -> None:
    p1 = FakeWorker("prefill", tokens)
    p2 = FakeWorker("prefill", tokens, num_running=1)  # ranked after p1
    d = FakeWorker("decode", tokens, fail_kv_times=1)

    async def body() -> None:
        async with router(tiny_model_path, [p1, p2, d]) as client:
            resp = await client.post("/v1/completions", json=completion(5))
            data = await resp.json()
            assert resp.status == 200, data
            assert data["choices"][0]["text"] == _text(tiny_model_path, tokens, 5)
            rid = _rid(p1, "/prefill")
            assert d.paths() == ["/reserve", "/decode", "/release", "/reserve", "/decode"]
            assert p2.paths() == ["/prefill"] and _rid(p2, "/prefill") == f"{rid}.r1"
            assert d.reserved == {}

    run(body)


def test_failed_handoff_without_reprefill_recomputes_on_the_decode_worker(
    tiny_model_path: Path, tokens: list[int]
) -> None:
    p = FakeWorker("prefill", tokens)
    d = FakeWorker("decode", tokens, fail_kv_times=1)
    recovery = RecoveryConfig(steps=("retry_transfer", "local_prefill"))

    async def body() -> None:
        async with router(tiny_model_path, [p, d], recovery=recovery) as client:
            resp = await client.post("/v1/completions", json=completion(5))
            data = await resp.json()
            assert resp.status == 200, data
            assert data["choices"][0]["text"] == _text(tiny_model_path, tokens, 5)
            assert d.paths()[:4] == ["/reserve", "/decode", "/release", "/generate"]
            assert p.paths().count("/prefill") == 1

    run(body)


def test_no_recovery_steps_fail_the_request_with_a_typed_error(
    tiny_model_path: Path, tokens: list[int]
) -> None:
    p = FakeWorker("prefill", tokens)
    d = FakeWorker("decode", tokens, fail_kv_times=1)

    async def body() -> None:
        async with router(tiny_model_path, [p, d], recovery=RecoveryConfig(steps=())) as client:
            resp = await client.post("/v1/completions", json=completion(5))
            data = await resp.json()
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            assert "KVNotReady" in data["error"]["message"]
            assert "/generate" not in d.paths() and d.reserved == {}

    run(body)


def test_dead_prefill_side_falls_back_to_local_prefill(
    tiny_model_path: Path, tokens: list[int]
) -> None:
    p1 = FakeWorker("prefill", tokens, fail_prefill=True)
    p2 = FakeWorker("prefill", tokens, fail_prefill=True)
    d = FakeWorker("decode", tokens)

    async def body() -> None:
        async with router(tiny_model_path, [p1, p2, d]) as client:
            resp = await client.post("/v1/completions", json=completion(4))
            data = await resp.json()
            assert resp.status == 200, data
            assert data["choices"][0]["text"] == _text(tiny_model_path, tokens, 4)
            # One prefill each (the re-prefill budget is 1), then the decode worker alone.
            assert p1.paths() == ["/prefill", "/release"] and p2.paths() == ["/prefill", "/release"]
            assert d.paths()[-1] == "/generate" and d.reserved == {}

    run(body)


def test_decode_death_after_commit_migrates_after_the_sent_tokens(
    tiny_model_path: Path, tokens: list[int]
) -> None:
    p = FakeWorker("prefill", tokens)
    d1 = FakeWorker("decode", tokens, cut_after_tokens=2)
    d2 = FakeWorker("decode", tokens, num_running=1)

    async def body() -> None:
        async with router(tiny_model_path, [p, d1, d2]) as client:
            resp = await client.post("/v1/completions", json=completion(6, return_token_ids=True))
            data = await resp.json()
            assert resp.status == 200, data
            choice = data["choices"][0]
            assert choice["token_ids"] == tokens[:6]  # none lost, none twice
            assert choice["text"] == _text(tiny_model_path, tokens, 6)
            assert d2.paths() == ["/generate"]

    run(body)


def test_refused_reservations_wait_in_the_queue_and_never_prefill_first(
    tiny_model_path: Path, tokens: list[int]
) -> None:
    # Room for one request at a time: the second waits in the queue (no prefill, no polling)
    # and is woken when the first one's release frees the slot, in arrival order.
    p = FakeWorker("prefill", tokens)
    d = FakeWorker("decode", tokens, capacity=1, token_delay_s=0.05)
    recovery = RecoveryConfig(queue_timeout_s=5.0)

    async def body() -> None:
        async with router(tiny_model_path, [p, d], recovery=recovery) as client:
            first = asyncio.create_task(client.post("/v1/completions", json=completion(6)))
            while "/decode" not in d.paths():
                await asyncio.sleep(0.01)
            second = await client.post("/v1/completions", json=completion(3))
            assert second.status == 200, await second.text()
            assert (await first).status == 200
            reserves = [rid for path, rid in d.calls if path == "/reserve"]
            # The second was refused once, then reserved once after the first ended: woken by
            # the release, never by a timer.
            assert len(reserves) == 3 and reserves[1] == reserves[2] != reserves[0]
            assert [path for path, _ in p.calls if path == "/prefill"] == ["/prefill"] * 2

    run(body)


def test_full_decode_without_a_queue_is_503_with_retry_after(
    tiny_model_path: Path, tokens: list[int]
) -> None:
    p = FakeWorker("prefill", tokens)
    d = FakeWorker("decode", tokens, refuse_reserve=True)
    recovery = RecoveryConfig(queue_timeout_s=0.0)

    async def body() -> None:
        async with router(tiny_model_path, [p, d], recovery=recovery) as client:
            resp = await client.post("/v1/completions", json=completion(3))
            assert resp.status == 503
            assert resp.headers["Retry-After"] == "1"
            assert "no capacity" in (await resp.json())["error"]["message"]
            assert p.paths() == []  # a refused reservation never wastes a prefill

    run(body)


def test_queue_gives_up_after_its_timeout(tiny_model_path: Path, tokens: list[int]) -> None:
    p = FakeWorker("prefill", tokens)
    d = FakeWorker("decode", tokens, refuse_reserve=True)
    recovery = RecoveryConfig(queue_timeout_s=0.3)

    async def body() -> None:
        async with router(tiny_model_path, [p, d], recovery=recovery) as client:
            resp = await client.post("/v1/completions", json=completion(3))
            assert resp.status == 503
            assert "waited 0.3 s" in (await resp.json())["error"]["message"]
            # Nothing freed room meanwhile, so nothing woke it: one reserve, no polling.
            assert d.paths() == ["/reserve"] and p.paths() == []

    run(body)


def test_breaker_colocates_after_failed_handoffs_and_a_probe_restores_disagg(
    tiny_model_path: Path, tokens: list[int]
) -> None:
    p = FakeWorker("prefill", tokens)
    d = FakeWorker("both", tokens, fail_kv_times=100)
    breaker = BreakerConfig(window=4, min_samples=2, failure_rate=0.5, cooldown_s=0.3)
    recovery = RecoveryConfig(steps=("local_prefill",))
    clock = FakeClock()

    async def body() -> None:
        async with router(
            tiny_model_path, [p, d], breaker=breaker, recovery=recovery, clock=clock
        ) as client:
            for _ in range(2):  # both handoffs fail; the decode worker recomputes locally
                resp = await client.post("/v1/completions", json=completion(3))
                assert resp.status == 200, await resp.text()
            health = await (await client.get("/health")).json()
            assert health["breaker"]["state"] == "open"
            assert (health["mode"], health["effective_mode"]) == ("disagg", "colocated")
            assert "2/2 handoffs failed" in health["breaker"]["last_transition"]
            d.calls.clear()
            resp = await client.post("/v1/completions", json=completion(3))
            assert resp.status == 200 and d.paths() == ["/generate"]  # colocated, no reserve
            d.fail_kv_times = 0  # the KV path heals
            clock.advance(0.35)  # past the cooldown
            d.calls.clear()
            resp = await client.post("/v1/completions", json=completion(3))
            assert resp.status == 200 and d.paths()[:2] == ["/reserve", "/decode"]  # the probe
            health = await (await client.get("/health")).json()
            assert health["breaker"]["state"] == "closed"
            text = await (await client.get("/metrics")).text()
            samples = parse(text)
            moves = "pdserve_router_breaker_transitions_total"
            assert total(samples, moves, **{"from": "closed", "to": "open"}) == 1
            assert total(samples, moves, **{"from": "half_open", "to": "closed"}) == 1
            assert total(samples, "pdserve_router_kv_handoffs_total", outcome="failed") == 2
            assert total(samples, "pdserve_router_breaker_state") == 0

    run(body)
