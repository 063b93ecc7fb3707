"""Router metrics against the timelines of the same requests, through the real flows (fake
workers): latencies, retries by reason, fallbacks, migrations, and the JSON timeline log."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from fake_worker import FakeWorker
from router_harness import completion, router, run

from pdserve.errors import ConfigError
from pdserve.model.tokenizer import Tokenizer
from pdserve.observability.exposition import Sample, parse, total
from pdserve.observability.phases import handoff_phases
from pdserve.observability.timeline_log import LOGGER_NAME
from pdserve.protocol.request_state import RequestState, Transition
from pdserve.router.config import RouterConfig


@pytest.fixture(scope="module")
def tokens(tiny_model_path: Path) -> list[int]:
    return Tokenizer(tiny_model_path).encode(
        " one two three four five six", add_special_tokens=False
    )


async def _metrics(client: TestClient) -> list[Sample]:  # type: ignore[type-arg]
    resp = await client.get("/metrics")
    return parse(await resp.text())


async def _timeline(client: TestClient, rid: str) -> dict[str, Any]:  # type: ignore[type-arg]
    resp = await client.get(f"/debug/requests/{rid}?workers=0")
    assert resp.status == 200
    data: dict[str, Any] = await resp.json()
    return data


async def _complete(client: TestClient, n: int, **kw: object) -> str:  # type: ignore[type-arg]
    resp = await client.post("/v1/completions", json=completion(n, **kw))
    data = await resp.json()
    assert resp.status == 200, data
    return str(data["id"])


def test_latency_histograms_equal_the_timelines(tiny_model_path: Path, tokens: list[int]) -> None:
    p = FakeWorker("prefill", tokens)
    d = FakeWorker("decode", tokens)

    async def body() -> None:
        async with router(tiny_model_path, [p, d]) as client:
            rids = [await _complete(client, n) for n in (1, 3, 5)]
            views = [await _timeline(client, rid) for rid in rids]
            samples = await _metrics(client)

            def hsum(name: str) -> float:
                return total(samples, f"pdserve_router_{name}_seconds_sum")

            def hcount(name: str) -> float:
                return total(samples, f"pdserve_router_{name}_seconds_count")

            received = [v["history"][0]["monotonic_ns"] for v in views]
            assert [v["num_output_tokens"] for v in views] == [1, 3, 5]
            ttfts = [(v["first_token_ns"] - r) / 1e9 for v, r in zip(views, received, strict=True)]
            assert hcount("ttft") == 3 and hsum("ttft") == pytest.approx(sum(ttfts), abs=1e-12)
            ends = [v["history"][-1] for v in views]
            assert all(e["state"] == "FINISHED" for e in ends)
            e2e = [(e["monotonic_ns"] - r) / 1e9 for e, r in zip(ends, received, strict=True)]
            assert hcount("e2e") == 3 and hsum("e2e") == pytest.approx(sum(e2e), abs=1e-12)
            # TPOT only for requests with a second token; ITL once per token after the first.
            tpots = [
                (v["last_token_ns"] - v["first_token_ns"]) / 1e9 / (v["num_output_tokens"] - 1)
                for v in views[1:]
            ]
            assert hcount("tpot") == 2 and hsum("tpot") == pytest.approx(sum(tpots), abs=1e-12)
            assert hcount("itl") == 0 + 2 + 4
            # Phases: the max_tokens=1 request ends at PREFILLED (no transfer, no handoff).
            phases = [
                handoff_phases(
                    [
                        Transition(RequestState[t["state"]], t["monotonic_ns"], 0.0)
                        for t in v["history"]
                    ]
                )
                for v in views
            ]
            for metric, phase, n in (
                ("prefill", "prefill", 3),
                ("transfer", "transfer", 2),
                ("handoff_gap", "handoff", 2),
            ):
                expected = sum(ph[phase] for ph in phases if phase in ph)
                assert hcount(metric) == n
                assert hsum(metric) == pytest.approx(expected, abs=1e-12)
            assert hcount("queue") == 3
            ok = total(samples, "pdserve_router_requests_total", mode="disagg", status="ok")
            assert ok == 3
            assert total(samples, "pdserve_router_retries_total") == 0
            assert total(samples, "pdserve_router_worker_up") == 2
            free = total(samples, "pdserve_router_worker_blocks_free", worker=d.url)
            assert free == d.num_free_blocks

    run(body)


def test_retries_fallbacks_and_migrations_are_counted_by_reason(
    tiny_model_path: Path, tokens: list[int]
) -> None:
    p1 = FakeWorker("prefill", tokens)
    p2 = FakeWorker("prefill", tokens, num_running=1)
    d1 = FakeWorker("decode", tokens, fail_kv_times=1)  # one failed handoff → re-prefill
    d2 = FakeWorker("decode", tokens, num_running=5)

    async def body() -> None:
        async with router(tiny_model_path, [p1, p2, d1, d2]) as client:
            await _complete(client, 4)
            samples = await _metrics(client)
            assert total(samples, "pdserve_router_retries_total", reason="reprefill") == 1
            assert total(samples, "pdserve_router_retries_total") == 1
            assert total(samples, "pdserve_router_kv_handoffs_total", outcome="failed") == 1
            # A decode stream cut after the commit: migration to d2.
            d1.cut_after_tokens = 2
            await _complete(client, 6)
            samples = await _metrics(client)
            assert total(samples, "pdserve_router_migrations_total") == 1
            assert total(samples, "pdserve_router_retries_total", reason="migration") == 1
            # Both prefill workers failing: the decode worker prefills locally (a fallback).
            d1.cut_after_tokens = None
            p1.fail_prefill = p2.fail_prefill = True
            await _complete(client, 3)
            samples = await _metrics(client)
            assert total(samples, "pdserve_router_fallbacks_total", reason="local_prefill") == 1
            assert total(samples, "pdserve_router_retries_total", reason="prefill_failed") == 1

    run(body)


def test_every_transition_is_a_json_log_line_and_the_debug_view_survives_old_workers(
    tiny_model_path: Path, tokens: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    p = FakeWorker("prefill", tokens)
    d = FakeWorker("decode", tokens)

    async def body() -> None:
        async with router(tiny_model_path, [p, d]) as client:
            with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
                rid = await _complete(client, 3)
            lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER_NAME]
            view = await _timeline(client, rid)
            assert [(x["event"], x["monotonic_ns"]) for x in lines if x["request_id"] == rid] == [
                (t["state"], t["monotonic_ns"]) for t in view["history"]
            ]
            assert {x["process"] for x in lines} == {"router"}
            # The fake workers have no /debug/requests: listed with the error, router events kept.
            resp = await client.get(f"/debug/requests/{rid}")
            full = await resp.json()
            assert resp.status == 200
            assert [c["error"] is not None for c in full["clocks"]] == [True, True]
            assert [e["event"] for e in full["merged"]] == [t["state"] for t in view["history"]]

    run(body)


def test_the_timeline_ring_keeps_the_configured_number_of_requests(
    tiny_model_path: Path, tokens: list[int]
) -> None:
    w = FakeWorker("both", tokens)

    async def body() -> None:
        async with router(tiny_model_path, [w], mode="colocated", timeline_ring=2) as client:
            rids = [await _complete(client, 2) for _ in range(3)]
            statuses = [
                (await client.get(f"/debug/requests/{rid}?workers=0")).status for rid in rids
            ]
            assert statuses == [404, 200, 200]

    run(body)
    with pytest.raises(ConfigError, match="timeline-ring"):
        RouterConfig(workers=("http://w:1",), model=tiny_model_path, timeline_ring=0)
