"""The router's fault sites and readiness against fake workers: a close reads as a dead
connection to the worker concerned and the flow's own recovery runs; a bad rule fails the
config, named; /ready is 503 while no worker can take a request."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_worker import FakeWorker
from router_harness import completion, router, run

from pdserve.errors import ConfigError
from pdserve.model.tokenizer import Tokenizer
from pdserve.router.config import RouterConfig


@pytest.fixture(scope="module")
def tokens(tiny_model_path: Path) -> list[int]:
    return Tokenizer(tiny_model_path).encode(" one two three four", add_special_tokens=False)


def test_close_after_prefill_reprefills_on_the_other_prefill_worker(
    tiny_model_path: Path, tokens: list[int]
) -> None:
    p1 = FakeWorker("prefill", tokens)
    p2 = FakeWorker("prefill", tokens, num_running=1)  # ranked after p1
    d = FakeWorker("decode", tokens)
    faults = ("router.after_prefill:close",)

    async def body() -> None:
        async with router(tiny_model_path, [p1, p2, d], faults=faults) as client:
            resp = await client.post("/v1/completions", json=completion(4))
            data = await resp.json()
            assert resp.status == 200, data
            assert data["choices"][0]["text"] == Tokenizer(tiny_model_path).decode(tokens[:4])
            # p1 prefilled, then its leg was dropped (released on both sides); p2 took over.
            assert p1.paths() == ["/prefill", "/release"]
            assert p2.paths() == ["/prefill"]
            assert d.paths() == ["/reserve", "/release", "/reserve", "/decode"]
            assert d.reserved == {}

    run(body)


def test_close_before_reserve_moves_to_the_next_decode_worker(
    tiny_model_path: Path, tokens: list[int]
) -> None:
    p = FakeWorker("prefill", tokens)
    d1 = FakeWorker("decode", tokens)
    d2 = FakeWorker("decode", tokens, num_running=1)  # ranked after d1
    faults = ("router.before_reserve:close",)

    async def body() -> None:
        async with router(tiny_model_path, [p, d1, d2], faults=faults) as client:
            resp = await client.post("/v1/completions", json=completion(3))
            assert resp.status == 200, await resp.text()
            assert d1.paths() == []  # the injected close happened before any call to d1
            assert d2.paths() == ["/reserve", "/decode"]

    run(body)


def test_a_bad_router_fault_rule_is_a_config_error_naming_it(tiny_model_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown site .router\.nowhere."):
        RouterConfig(
            workers=("http://127.0.0.1:1",), model=tiny_model_path, faults=("router.nowhere:crash",)
        )


def test_ready_is_503_until_a_worker_can_take_a_request(tiny_model_path: Path) -> None:
    async def body() -> None:
        async with router(tiny_model_path, [FakeWorker("prefill", [1])]) as client:
            resp = await client.get("/ready")
            assert resp.status == 503 and await resp.json() == {"ready": False, "mode": "disagg"}
        workers = [FakeWorker("prefill", [1]), FakeWorker("both", [1])]
        async with router(tiny_model_path, workers) as client:
            resp = await client.get("/ready")
            assert resp.status == 200 and (await resp.json())["ready"] is True

    run(body)


def test_the_reservation_is_renewed_while_a_slow_prefill_runs(
    tiny_model_path: Path, tokens: list[int]
) -> None:
    """A prefill that takes longer than the lease TTL: the router renews the decode
    reservation about every TTL/3 while it waits, and stops once the prefill answered."""
    p = FakeWorker("prefill", tokens, prefill_delay_s=1.0)
    d = FakeWorker("decode", tokens)

    async def body() -> None:
        async with router(tiny_model_path, [p, d], lease_ttl_s=0.3) as client:
            resp = await client.post("/v1/completions", json=completion(3))
            assert resp.status == 200, await resp.text()
            paths = d.paths()
            assert paths[0] == "/reserve" and paths[-1] == "/decode"
            renewals = paths.count("/renew")
            assert 2 <= renewals <= 10, paths  # ~1.0 s / 0.1 s, whatever the scheduling
            assert set(paths[1:-1]) == {"/renew"}  # none after the prefill answered

    run(body)
