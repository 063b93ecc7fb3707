"""The disaggregated flow with affinity, against fake workers: which calls each turn makes.

A conversation's second turn goes to the decode worker that served the first and runs there
with /generate (local prefill of the suffix: no reservation, no prefill worker); when that
worker is gone the turn still succeeds on the other one, which then holds the conversation.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient
from fake_worker import FakeWorker
from router_harness import router, run

from pdserve.model.tokenizer import Tokenizer

FIRST = list(range(300, 340))  # 40 prompt tokens: 2 whole blocks of 16
OUT = 4


@pytest.fixture(scope="module")
def tokens(tiny_model_path: Path) -> list[int]:
    return Tokenizer(tiny_model_path).encode(
        " the cat sat on the mat and", add_special_tokens=False
    )


async def until_router_sees(
    client: TestClient,  # type: ignore[type-arg]
    url: str,
    num_running: int,
    timeout_s: float = 10.0,
) -> None:
    """Poll the router's /health until its view of the worker at `url` (from its own health
    polls) shows `num_running`."""
    async with asyncio.timeout(timeout_s):
        while True:
            workers = (await (await client.get("/health")).json())["workers"]
            if any(w["url"] == url and w["num_running"] == num_running for w in workers):
                return
            await asyncio.sleep(0.01)


def body(model: Path, prompt: list[int], session: str | None = None) -> dict[str, object]:
    b: dict[str, object] = {
        "model": model.name,
        "prompt": prompt,
        "max_tokens": OUT,
        "temperature": 0,
        "return_token_ids": True,
    }
    if session is not None:
        b["user"] = session
    return b


def test_second_turn_runs_on_the_holder_without_prefill_or_transfer(
    tiny_model_path: Path, tokens: list[int]
) -> None:
    prefill = FakeWorker("prefill", tokens, worker_id="p")
    decodes = [FakeWorker("both", tokens, worker_id=f"d{i}") for i in range(2)]

    async def go() -> None:
        async with router(tiny_model_path, [prefill, *decodes]) as client:
            resp = await client.post("/v1/completions", json=body(tiny_model_path, FIRST, "s"))
            data = await resp.json()
            assert resp.status == 200, data
            out = data["choices"][0]["token_ids"]
            holder = next(d for d in decodes if "/reserve" in d.paths())
            other = decodes[1 - decodes.index(holder)]
            for w in (prefill, *decodes):
                w.calls.clear()

            second = [*FIRST, *out, *range(400, 408)]
            resp = await client.post("/v1/completions", json=body(tiny_model_path, second, "s"))
            assert resp.status == 200, await resp.text()
            assert holder.paths() == ["/generate"]
            assert prefill.paths() == [] and other.paths() == []
            rid = holder.calls[-1][1]
            timeline = await (await client.get(f"/debug/requests/{rid.rsplit('.', 1)[0]}")).json()
            assert [t["state"] for t in timeline["history"]] == [
                "RECEIVED",
                "ROUTED",
                "DECODING",
                "FINISHED",
            ]

            # A different conversation (no shared prefix) takes the disaggregated path.
            holder.calls.clear()
            resp = await client.post(
                "/v1/completions", json=body(tiny_model_path, list(range(600, 640)), "t")
            )
            assert resp.status == 200
            assert prefill.paths() == ["/prefill"]

    run(go)


def test_when_the_holder_is_gone_the_turn_succeeds_elsewhere_and_affinity_moves(
    tiny_model_path: Path, tokens: list[int]
) -> None:
    prefill = FakeWorker("prefill", tokens, worker_id="p")
    decodes = [FakeWorker("both", tokens, worker_id=f"d{i}") for i in range(2)]

    async def go() -> None:
        async with router(tiny_model_path, [prefill, *decodes]) as client:
            resp = await client.post("/v1/completions", json=body(tiny_model_path, FIRST, "s"))
            out = (await resp.json())["choices"][0]["token_ids"]
            holder = next(d for d in decodes if "/reserve" in d.paths())
            survivor = decodes[1 - decodes.index(holder)]
            await holder.close()  # the holder's process is gone: connections are refused
            survivor.calls.clear()

            second = [*FIRST, *out, *range(400, 408)]
            resp = await client.post("/v1/completions", json=body(tiny_model_path, second, "s"))
            assert resp.status == 200, await resp.text()
            out2 = (await resp.json())["choices"][0]["token_ids"]
            # Re-prefilled in full on the survivor (it holds nothing of this conversation).
            assert survivor.paths() == ["/generate"]

            survivor.calls.clear()
            prefill.calls.clear()
            third = [*second, *out2, *range(500, 508)]
            resp = await client.post("/v1/completions", json=body(tiny_model_path, third, "s"))
            assert resp.status == 200
            # The survivor is the holder now: local suffix prefill again.
            assert survivor.paths() == ["/generate"]
            assert prefill.paths() == []

    run(go)


@pytest.mark.parametrize("via", ["user", "x-session-id"])
def test_colocated_mode_keeps_a_session_on_its_worker_against_load(
    tiny_model_path: Path, tokens: list[int], via: str
) -> None:
    workers = [FakeWorker("both", tokens, worker_id=f"w{i}") for i in range(2)]

    async def post(client: TestClient, prompt: list[int]) -> ClientResponse:  # type: ignore[type-arg]
        if via == "user":
            return await client.post("/v1/completions", json=body(tiny_model_path, prompt, "s"))
        return await client.post(
            "/v1/completions",
            json=body(tiny_model_path, prompt),
            headers={"x-session-id": "s"},
        )

    async def go() -> None:
        async with router(
            tiny_model_path, workers, mode="colocated", health_poll_interval_s=0.02
        ) as client:
            resp = await post(client, FIRST)
            out = (await resp.json())["choices"][0]["token_ids"]
            holder = next(w for w in workers if "/generate" in w.paths())
            other = workers[1 - workers.index(holder)]
            # The holder now looks busier: least-load alone would move the conversation.
            holder.num_running = 1
            await until_router_sees(client, holder.url, num_running=1)
            holder.calls.clear()
            other.calls.clear()
            second = [*FIRST, *out, *range(400, 408)]
            resp = await post(client, second)
            assert resp.status == 200
            assert holder.paths() == ["/generate"] and other.paths() == []
            # A new conversation goes by cost: the idle worker.
            resp = await client.post(
                "/v1/completions", json=body(tiny_model_path, list(range(600, 640)), "t")
            )
            assert resp.status == 200
            assert other.paths() == ["/generate"]

    run(go)
