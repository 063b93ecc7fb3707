"""Router-assigned roles and the admin side of modes, against fake `both` workers: an
operator's split, bad bodies, auto mode's switch, interference metrics, and one evaluation of
the automatic mode applied to the pool and the dispatcher."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp
import pytest
from fake_worker import FakeWorker
from router_harness import completion, router, run
from waiting import until

from pdserve.clock import FakeClock
from pdserve.model.tokenizer import Tokenizer
from pdserve.observability.exposition import parse, render_text, total
from pdserve.observability.request_stats import RequestStats
from pdserve.protocol.worker_api import StepInfo, WorkerHealth
from pdserve.router.config import AffinityConfig
from pdserve.router.flows.dispatcher import Dispatcher
from pdserve.router.flows.flow import Flow
from pdserve.router.mode.auto_controller import AutoController
from pdserve.router.mode.auto_mode import Action, AutoConfig, Reason
from pdserve.router.mode.interference import SLOConfig
from pdserve.router.mode.live_monitor import LiveMonitor
from pdserve.router.mode.roles import AssignedPool, RoleOverlay, assignable, choose_prefill
from pdserve.router.placement.policy import WorkerView, pick_prefill, rank_colocated, rank_decode
from pdserve.router.workers.client import ClientTimeouts, WorkerClient


@pytest.fixture(scope="module")
def tokens(tiny_model_path: Path) -> list[int]:
    return Tokenizer(tiny_model_path).encode(" the cat sat on the mat", add_special_tokens=False)


def _view(
    url: str, index: int, role: str = "both", running: int = 0, digest: str = "A"
) -> WorkerView:
    health = WorkerHealth(
        worker_id=url, role=role, pid=index, fingerprint={}, fingerprint_digest=digest,  # type: ignore[arg-type]
        transfer_address="h:1", max_model_len=256, block_size=16, num_blocks=100,
        num_free_blocks=100, num_pinned_blocks=0, num_running=running, num_waiting=0,
        num_active_leases=0,
    )  # fmt: skip
    return WorkerView(url, index, health, True)


def test_the_overlay_turns_both_workers_into_prefill_candidates_only() -> None:
    views = [_view("a", 0), _view("b", 1, running=3), _view("c", 2), _view("p", 3, "prefill")]
    overlay = RoleOverlay()
    overlay.assign({"a", "p"})
    marked = overlay.apply(views)
    assert [v.role for v in marked] == ["prefill", "both", "both", "prefill"]
    assert [v.assigned_role for v in marked] == ["prefill", None, None, None]
    assert [v.url for v in rank_decode(marked)] == ["c", "b"]
    assert [v.url for v in rank_colocated(marked)] == ["c", "b"]
    chosen = pick_prefill(marked, marked[2])
    assert chosen is not None and chosen.url == "a"  # an assigned worker counts as prefill
    overlay.assign(())
    assert [v.role for v in overlay.apply(views)] == ["both", "both", "both", "prefill"]


def test_prefill_workers_are_kept_then_least_loaded_then_in_list_order() -> None:
    views = [_view("a", 0, running=2), _view("b", 1), _view("c", 2, running=1), _view("d", 3)]
    assert choose_prefill(views, frozenset(), 2) == {"b", "d"}
    assert choose_prefill(views, frozenset({"a"}), 2) == {"a", "b"}
    assert choose_prefill(views, frozenset({"a", "c"}), 1) == {"c"}
    odd = [*views, _view("x", 4, digest="B"), _view("p", 5, role="prefill")]
    assert [v.url for v in assignable(odd, "A")] == ["a", "b", "c", "d"]


def test_an_operator_splits_both_workers_and_rejoins_them(
    tiny_model_path: Path, tokens: list[int]
) -> None:
    first, second = FakeWorker("both", tokens), FakeWorker("both", tokens)

    async def body() -> None:
        # Round robin: the two colocated requests at the end must land on both workers.
        rr = AffinityConfig(routing="round_robin")
        async with router(tiny_model_path, [first, second], "colocated", affinity=rr) as client:
            resp = await client.post("/admin/mode", json={"mode": "disagg", "num_prefill": 1})
            assert await resp.json() == {
                "mode": "disagg",
                "num_prefill": 1,
                "previous": "colocated",
            }
            health = await (await client.get("/health")).json()
            roles = {w["url"]: w["assigned_role"] for w in health["workers"]}
            assert set(roles.values()) == {"prefill", None}
            assert health["auto"]["num_prefill"] == 1 and health["auto"]["num_decode"] == 1
            assert health["status"] == "ok" and health["mode_setting"] == "disagg"
            resp = await client.post("/v1/completions", json=completion(3))
            assert resp.status == 200
            prefill = first if roles[first.url] == "prefill" else second
            decode = second if prefill is first else first
            assert prefill.paths() == ["/prefill"]
            assert decode.paths() == ["/reserve", "/decode"]
            resp = await client.post("/admin/mode", json={"mode": "colocated"})
            assert await resp.json() == {"mode": "colocated", "previous": "disagg"}
            health = await (await client.get("/health")).json()
            assert [w["assigned_role"] for w in health["workers"]] == [None, None]
            for _ in range(2):
                assert (await client.post("/v1/completions", json=completion(3))).status == 200
            assert "/generate" in first.paths() and "/generate" in second.paths()

    run(body)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"mode": "colocated", "num_prefill": 1}, "num_prefill"),
        ({"mode": "disagg", "num_prefill": 2}, "num_prefill"),
        ({"mode": "disagg", "num_prefill": 0}, "num_prefill"),
        ({"mode": "disagg", "num_prefill": "x"}, "num_prefill"),
        ({"mode": "sideways"}, "mode"),
        ({"mode": "auto", "extra": 1}, "extra"),
    ],
)
def test_a_bad_mode_change_is_a_400_naming_the_field_and_changes_nothing(
    tiny_model_path: Path, tokens: list[int], body: dict[str, object], param: str
) -> None:
    workers = [FakeWorker("both", tokens), FakeWorker("both", tokens)]

    async def test() -> None:
        async with router(tiny_model_path, workers, mode="colocated") as client:
            resp = await client.post("/admin/mode", json=body)
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert error["param"] == param and param in error["message"]
            health = await (await client.get("/health")).json()
            assert health["mode_setting"] == "colocated"
            assert [w["assigned_role"] for w in health["workers"]] == [None, None]

    run(test)


def test_auto_mode_is_switched_on_and_off_by_the_operator(
    tiny_model_path: Path, tokens: list[int]
) -> None:
    workers = [FakeWorker("both", tokens), FakeWorker("both", tokens)]

    async def body() -> None:
        async with router(tiny_model_path, workers, mode="auto") as client:
            health = await (await client.get("/health")).json()
            assert (health["mode_setting"], health["mode"], health["auto"]["enabled"]) == (
                "auto",
                "colocated",
                True,
            )
            resp = await client.post("/admin/mode", json={"mode": "disagg", "num_prefill": 1})
            assert (await resp.json())["previous"] == "auto"
            assert (await (await client.get("/health")).json())["auto"]["enabled"] is False
            resp = await client.post("/admin/mode", json={"mode": "auto"})
            assert await resp.json() == {"mode": "auto", "previous": "disagg"}
            health = await (await client.get("/health")).json()
            # Auto takes over from the current layout.
            assert health["auto"]["enabled"] and health["auto"]["num_prefill"] == 1
            auto = await (await client.get("/admin/auto")).json()
            assert auto["enabled"] is True and isinstance(auto["evaluations"], list)

    run(body)


def test_decode_tokens_are_measured_with_and_without_prefill(
    tiny_model_path: Path, tokens: list[int]
) -> None:
    # Token i of each stream reports prefill tokens [0, 0, 512, 0, ...][i % 4].
    worker = FakeWorker("both", tokens, step_prefill_tokens=[0, 0, 512, 0])

    async def body() -> None:
        async with router(
            tiny_model_path, [worker], mode="colocated", slo=SLOConfig(1.0, 0.5)
        ) as client:
            for _ in range(2):
                resp = await client.post("/v1/completions", json=completion(8, stream=True))
                await resp.read()
            samples = parse(await (await client.get("/metrics")).text())
            tpot = "pdserve_router_decode_tpot_seconds_count"
            # 8 tokens: token 0 is the prefill's; of tokens 1..7, 2 and 6 shared a step.
            assert total(samples, tpot, prefill="with") == 4
            assert total(samples, tpot, prefill="without") == 10
            assert total(samples, "pdserve_router_slo_requests_total", outcome="met") == 2
            assert total(samples, "pdserve_router_slo_attainment", slo="both") == 1.0
            health = await (await client.get("/health")).json()
            assert health["auto"]["decode_with_prefill"]["num_tokens"] == 4

    run(body)


class _NoFlow:
    def stream(self, request: object) -> object:
        raise AssertionError("no request is served here")


def test_one_evaluation_splits_the_pool_and_sets_the_mode(tokens: list[int]) -> None:
    workers = [FakeWorker("both", tokens), FakeWorker("both", tokens, num_running=4)]
    clock = FakeClock(500.0)
    slo = SLOConfig(ttft_s=1.0, tpot_s=0.010)
    monitor = LiveMonitor(slo, window_s=10.0, clock=clock)
    # A window where decode alone is fast, but most requests missed TPOT after sharing
    # steps with prefill.
    for k in range(10):
        tracker = monitor.begin(1000, 8)
        monitor.chunk(tracker, None, None, 1)
        for j in range(4):
            prefill = 800 if (j == 2 and k < 5) else 0
            info = StepInfo(index=j, duration_s=0.003, num_prefill_tokens=prefill,
                            num_decode_tokens=1, decode=True)  # fmt: skip
            monitor.chunk(tracker, info, 0.003, 1)
        tpot = 0.05 if k < 5 else 0.004
        monitor.end(tracker, RequestStats(0.1, 0.2, tpot, None), finished=True)

    async def body() -> None:
        for w in workers:
            await w.start()
        async with aiohttp.ClientSession() as session:
            pool = AssignedPool(
                [w.url for w in workers],
                WorkerClient(session, ClientTimeouts()),
                overlay=RoleOverlay(),
            )
            await pool.poll_once()
            flows: dict[str, Flow] = {"disagg": _NoFlow(), "colocated": _NoFlow()}  # type: ignore[dict-item]
            dispatcher = Dispatcher("colocated", flows)  # type: ignore[arg-type]
            config = AutoConfig(sustain=1, min_dwell_s=0.0, min_requests=5)
            controller = AutoController(
                config, monitor, pool, dispatcher, clock=clock, enabled=True
            )
            decision = controller.evaluate()
            assert (decision.action, decision.reason) == (Action.SPLIT, Reason.INTERFERENCE)
            # The idle worker takes the prefill role; the busy one keeps decoding.
            assert pool.overlay.prefill_urls == {workers[0].url}
            assert dispatcher.mode == "disagg"
            assert controller.layout_counts() == (1, 1)
            assert controller.counts[(Action.SPLIT, Reason.INTERFERENCE)] == 1
            rendered = parse(render_text(controller.render()))
            assert total(rendered, "pdserve_router_auto_split") == 1
            assert total(rendered, "pdserve_router_auto_workers", role="prefill") == 1
            assert (
                total(
                    rendered,
                    "pdserve_router_auto_decisions_total",
                    action="split",
                    reason="interference",
                )
                == 1
            )
            # An operator takes over: the controller stops deciding.
            controller.disable()
            assert not controller.enabled
        for w in workers:
            await w.close()

    asyncio.run(body())


def test_the_controller_loop_survives_and_stops(tokens: list[int]) -> None:
    async def body() -> None:
        async with aiohttp.ClientSession() as session:
            pool = AssignedPool([], WorkerClient(session, ClientTimeouts()), overlay=RoleOverlay())
            monitor = LiveMonitor(SLOConfig(), 10.0)
            dispatcher = Dispatcher("colocated", {})
            controller = AutoController(
                AutoConfig(interval_s=0.01), monitor, pool, dispatcher, enabled=True
            )
            controller.start()
            await until(lambda: controller.history, what="one evaluation")
            await controller.stop()
            assert (
                controller.history
                and controller.history[-1].decision.reason is Reason.TOO_FEW_WORKERS
            )
            with contextlib.suppress(Exception):
                controller.disable()

    asyncio.run(body())
