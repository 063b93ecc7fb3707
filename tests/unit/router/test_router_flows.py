"""The router against fake workers: call order, releases, colocated mode, mode switch, errors.

Each test runs one coroutine under `asyncio.run`: fake workers and the router on in-process
aiohttp test servers (loopback, port 0), a TestClient to talk to the router.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fake_worker import FakeWorker
from router_harness import completion, router, run
from waiting import until

from pdserve.model.tokenizer import Tokenizer
from pdserve.observability.exposition import parse, total
from pdserve.router.api import sse
from pdserve.router.config import RecoveryConfig


@pytest.fixture(scope="module")
def tokens(tiny_model_path: Path) -> list[int]:
    return Tokenizer(tiny_model_path).encode(
        " the cat sat on the mat and", add_special_tokens=False
    )


@pytest.fixture(scope="module")
def model(tiny_model_path: Path) -> Path:
    return tiny_model_path


def test_disagg_reserves_before_prefill_and_streams(model: Path, tokens: list[int]) -> None:
    prefill, decode = FakeWorker("prefill", tokens), FakeWorker("decode", tokens)
    text = Tokenizer(model).decode(tokens[:4])

    async def body() -> None:
        async with router(model, [prefill, decode]) as client:
            resp = await client.post("/v1/completions", json=completion(model=model.name))
            data = await resp.json()
            assert resp.status == 200, data
            assert data["choices"][0] == {"index": 0, "text": text, "logprobs": None,
                                          "finish_reason": "length"}  # fmt: skip
            assert data["usage"]["completion_tokens"] == 4
            assert decode.paths() == ["/reserve", "/decode"]
            assert prefill.paths() == ["/prefill"]
            rid = decode.calls[1][1]
            assert prefill.calls[-1][1] == rid
            timeline = await (await client.get(f"/debug/requests/{rid}")).json()
            assert [t["state"] for t in timeline["history"]] == [
                "RECEIVED", "ROUTED", "RESERVED", "PREFILLING", "PREFILLED", "TRANSFERRING",
                "COMMITTED", "DECODING", "FINISHED",
            ]  # fmt: skip

    run(body)


def test_refused_reserve_tries_next_decode_then_503_never_prefill(
    model: Path, tokens: list[int]
) -> None:
    prefill = FakeWorker("prefill", tokens)
    full = FakeWorker("decode", tokens, refuse_reserve=True, num_free_blocks=999)
    ok = FakeWorker("decode", tokens, num_free_blocks=1)

    async def body() -> None:
        async with router(model, [prefill, full, ok]) as client:
            resp = await client.post("/v1/completions", json=completion())
            assert resp.status == 200
            assert full.paths() == ["/reserve"] and ok.paths() == ["/reserve", "/decode"]
            assert prefill.calls[-1][1] == ok.calls[1][1]
            ok.refuse_reserve = True
            prefill.calls.clear()
            resp = await client.post("/v1/completions", json=completion())
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["type"] == "server_error"
            assert prefill.paths() == []  # a failed reservation never wastes a prefill
            metrics = await (await client.get("/metrics")).text()
            samples, name = parse(metrics), "pdserve_router_requests_total"
            assert total(samples, name, mode="disagg", status="no_capacity") == 1
            assert total(samples, name, mode="disagg", status="ok") == 1

    run(body)


def test_failed_prefill_releases_the_reservation(model: Path, tokens: list[int]) -> None:
    prefill = FakeWorker("prefill", tokens, fail_prefill=True, fail_prefill_retryable=False)
    decode = FakeWorker("decode", tokens)

    async def body() -> None:
        async with router(model, [prefill, decode]) as client:
            resp = await client.post("/v1/completions", json=completion())
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            assert decode.paths() == ["/reserve", "/release"]
            assert decode.reserved == {}

    run(body)


def test_retryable_prefill_failure_retries_on_another_prefill_worker(
    model: Path, tokens: list[int]
) -> None:
    bad = FakeWorker("prefill", tokens, fail_prefill=True)
    good = FakeWorker("prefill", tokens, num_running=1)  # ranked after `bad`
    decode = FakeWorker("decode", tokens)

    async def body() -> None:
        async with router(model, [bad, good, decode]) as client:
            resp = await client.post("/v1/completions", json=completion())
            assert resp.status == 200
            rid = bad.calls[-1][1]
            assert decode.paths() == ["/reserve", "/release", "/reserve", "/decode"]
            assert good.calls[-1][1] == f"{rid}.r1" == decode.calls[-1][1]

    run(body)


def test_a_reservation_that_expired_during_prefill_is_re_prefilled_not_a_502(
    model: Path, tokens: list[int]
) -> None:
    # The prefill worker was paused past the reservation's lease: the decode worker no longer
    # knows the request (404) when the router asks it to decode. That is recoverable.
    paused = FakeWorker("prefill", tokens)
    other = FakeWorker("prefill", tokens, num_running=1)  # ranked after `paused`
    decode = FakeWorker("decode", tokens, expire_reservations_times=1)

    async def body() -> None:
        async with router(model, [paused, other, decode]) as client:
            resp = await client.post("/v1/completions", json=completion())
            assert resp.status == 200, await resp.text()
            rid = paused.calls[-1][1]
            assert decode.paths() == ["/reserve", "/decode", "/release", "/reserve", "/decode"]
            assert other.calls[-1][1] == f"{rid}.r1" == decode.calls[-1][1]

    run(body)


def test_client_disconnect_mid_stream_releases(model: Path, tokens: list[int]) -> None:
    prefill = FakeWorker("prefill", tokens)
    decode = FakeWorker("decode", tokens, token_delay_s=0.05)

    async def body() -> None:
        async with router(model, [prefill, decode]) as client:
            resp = await client.post("/v1/completions", json=completion(50, stream=True))
            assert resp.status == 200
            await resp.content.readline()
            resp.close()  # the client goes away
            for _ in range(100):
                if "/release" in decode.paths():
                    break
                await asyncio.sleep(0.02)
            assert decode.paths() == ["/reserve", "/decode", "/release"]

    run(body)


def test_stop_string_ends_the_stream_and_releases(model: Path, tokens: list[int]) -> None:
    tokenizer = Tokenizer(model)
    full = tokenizer.decode(tokens)
    stop = full[full.index(" sat") :][:4]  # " sat"
    prefill, decode = FakeWorker("prefill", tokens), FakeWorker("decode", tokens)

    async def body() -> None:
        async with router(model, [prefill, decode]) as client:
            req = completion(len(tokens), stop=[stop], stream=True,
                             stream_options={"include_usage": True})  # fmt: skip
            resp = await client.post("/v1/completions", json=req)
            events = sse.parse_events(await resp.read())
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            assert text == full[: full.index(stop)]
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 0

    run(body)


def test_colocated_mode_and_runtime_switch(model: Path, tokens: list[int]) -> None:
    both = FakeWorker("both", tokens)
    prefill = FakeWorker("prefill", tokens)

    async def body() -> None:
        async with router(model, [prefill, both], mode="colocated") as client:
            chat = {"model": "tiny-v2", "max_tokens": 3, "stream": True,
                    "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
            resp = await client.post("/v1/chat/completions", json=chat)
            events = sse.parse_events(await resp.read())
            first = json.loads(events[0])
            assert first["object"] == "chat.completion.chunk"
            assert first["choices"][0]["delta"]["role"] == "assistant"
            assert both.paths() == ["/generate"] and prefill.paths() == []
            health = await (await client.get("/health")).json()
            assert health["mode"] == "colocated" and health["status"] == "ok"

            resp = await client.post("/admin/mode", json={"mode": "disagg"})
            assert await resp.json() == {"mode": "disagg", "previous": "colocated"}
            resp = await client.post("/v1/completions", json=completion(3))
            assert resp.status == 200
            assert both.paths() == ["/generate", "/reserve", "/decode"]
            assert prefill.paths() == ["/prefill"]
            resp = await client.post("/admin/mode", json={"mode": "sideways"})
            assert resp.status == 400

    run(body)


def test_in_flight_request_finishes_in_its_starting_mode(model: Path, tokens: list[int]) -> None:
    both = FakeWorker("both", tokens, token_delay_s=0.02)
    prefill = FakeWorker("prefill", tokens)

    async def body() -> None:
        async with router(model, [prefill, both], mode="colocated") as client:
            pending = asyncio.create_task(client.post("/v1/completions", json=completion(8)))
            while "/generate" not in both.paths():
                await asyncio.sleep(0.01)
            await client.post("/admin/mode", json={"mode": "disagg"})
            resp = await pending
            data = await resp.json()
            assert resp.status == 200 and data["choices"][0]["finish_reason"] == "length"
            assert both.paths() == ["/generate"]  # no disagg calls for the in-flight request

    run(body)


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"model": "gpt-4"}, "model"),
        ({"n": 0}, "n"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"n": 2, "best_of": 3, "stream": True}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"min_p": 2}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 100}, "min_tokens"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"seed": 2**64}, "seed"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"suffix": "x"}, "suffix"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}}, "guided_json"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"prompt": "word " * 5000}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_bad_requests_are_400_with_param(
    model: Path, tokens: list[int], patch: dict[str, object], param: str
) -> None:
    both = FakeWorker("both", tokens)

    async def body() -> None:
        async with router(model, [both], mode="colocated") as client:
            resp = await client.post("/v1/completions", json={**completion(), **patch})
            data = await resp.json()
            assert resp.status == 400, data
            assert data["error"]["type"] == "invalid_request_error"
            assert data["error"]["param"] == param
            assert both.paths() == []
            # The router keeps serving.
            assert (await client.post("/v1/completions", json=completion())).status == 200

    run(body)


def test_malformed_json_auth_and_models(model: Path, tokens: list[int]) -> None:
    both = FakeWorker("both", tokens)

    async def body() -> None:
        async with router(model, [both], mode="colocated", api_key="sekret-key") as client:
            resp = await client.post("/v1/completions", json=completion())
            assert resp.status == 401
            auth = {"Authorization": "Bearer sekret-key"}
            raw = {**auth, "Content-Type": "application/json"}
            resp = await client.post("/v1/completions", data=b"{nope", headers=raw)
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == "invalid_json"
            models = await (await client.get("/v1/models", headers=auth)).json()
            assert models["data"][0]["id"] == model.name
            assert (await client.get("/health")).status == 200  # health needs no key

    run(body)


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_requests_wait_for_a_worker_to_come_back_then_run(
    model: Path, tokens: list[int], mode: str
) -> None:
    """No worker up (a partition, a pause): a request waits in the capacity queue instead of
    failing at once, and runs as soon as a worker answers its health poll again."""
    workers = (
        [FakeWorker("both", tokens, down=True)]
        if mode == "colocated"
        else [FakeWorker("prefill", tokens, down=True), FakeWorker("decode", tokens, down=True)]
    )

    async def body() -> None:
        async with router(model, workers, mode=mode) as client:  # type: ignore[arg-type]
            sent = asyncio.create_task(client.post("/v1/completions", json=completion()))
            await until(lambda: sum(p == "/health" for w in workers for p, _ in w.calls) >= 6,
                        5, "rechecks while down")  # fmt: skip
            assert not sent.done()
            loop = asyncio.get_running_loop()
            healed = loop.time()
            for w in workers:
                w.down = False
            resp = await sent
            assert resp.status == 200, await resp.text()
            assert loop.time() - healed < 2.0

    run(body)


def test_a_request_that_waited_out_the_queue_gets_503_with_retry_after(
    model: Path, tokens: list[int]
) -> None:
    both = FakeWorker("both", tokens, down=True)

    async def body() -> None:
        config = RecoveryConfig(queue_timeout_s=0.5)
        async with router(model, [both], mode="colocated", recovery=config) as client:
            loop = asyncio.get_running_loop()
            start = loop.time()
            resp = await client.post("/v1/completions", json=completion())
            assert resp.status == 503 and resp.headers["Retry-After"]
            assert loop.time() - start >= 0.5
            assert "waited 0.5 s in the queue" in (await resp.json())["error"]["message"]

    run(body)
