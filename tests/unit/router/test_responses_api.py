"""POST /v1/responses through the router on fake workers: the Response object, the stream's
typed events in the order the official client expects (and the same items as the whole
answer), function calls and their results, previous_response_id with the store on and off,
and every malformed request refused by field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fake_worker import FakeWorker
from router_harness import router, run

from pdserve.model.tokenizer import Tokenizer

TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}}}}  # fmt: skip
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>'


def emitting(tokenizer: Tokenizer, text: str) -> FakeWorker:
    """A colocated fake worker whose output is `text` then an EOS."""
    tokens = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_ids[0]]
    return FakeWorker("both", tokens, finish_reason="stop")


def events(raw: bytes) -> list[dict[str, Any]]:
    """The stream's events, checking each `event:` line names its data's type."""
    out = []
    for block in raw.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def same_but_ids(a: dict[str, Any], b: dict[str, Any]) -> bool:
    drop = ("id", "created_at", "call_id")

    def strip(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if k not in drop}
        return [strip(x) for x in v] if isinstance(v, list) else v

    return bool(strip(a) == strip(b))


@pytest.fixture
def tokenizer(tiny_model_path: Path) -> Tokenizer:
    return Tokenizer(tiny_model_path)


def test_text_whole_and_streamed(tiny_model_path: Path, tokenizer: Tokenizer) -> None:
    worker = emitting(tokenizer, "Hello there")
    n = len(worker.tokens)

    async def body() -> None:
        async with router(tiny_model_path, [worker], mode="colocated") as client:
            req = {"model": "tiny-v2", "input": "hi", "max_output_tokens": n,
                   "instructions": "Be brief.", "metadata": {"k": "v"}}  # fmt: skip
            resp = await client.post("/v1/responses", json=req)
            whole = await resp.json()
            assert resp.status == 200, whole
            assert whole["id"].startswith("resp_") and whole["object"] == "response"
            assert whole["status"] == "completed" and whole["metadata"] == {"k": "v"}
            [message] = whole["output"]
            assert message["type"] == "message" and message["role"] == "assistant"
            assert message["content"][0]["text"] == "Hello there"
            assert whole["usage"]["output_tokens"] == n and whole["store"] is False
            prompt = tokenizer.decode(worker.bodies[0].prompt_token_ids)  # type: ignore[union-attr]
            assert prompt.index("Be brief.") < prompt.index("hi")

            resp = await client.post("/v1/responses", json={**req, "stream": True})
            stream = events(await resp.read())
            assert [e["type"] for e in stream[:4]] == [
                "response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added",
            ]  # fmt: skip
            deltas = [e["delta"] for e in stream if e["type"] == "response.output_text.delta"]
            assert "".join(deltas) == "Hello there" and len(deltas) > 1
            assert [e["type"] for e in stream[-4:]] == [
                "response.output_text.done", "response.content_part.done",
                "response.output_item.done", "response.completed",
            ]  # fmt: skip
            assert same_but_ids(stream[-1]["response"], whole)

            short = await client.post("/v1/responses", json={**req, "max_output_tokens": 2})
            cut = await short.json()
            assert cut["status"] == "incomplete"
            assert cut["incomplete_details"] == {"reason": "max_output_tokens"}

    run(body)


def test_function_calls_stream_as_items(tiny_model_path: Path, tokenizer: Tokenizer) -> None:
    worker = emitting(tokenizer, CALL)

    async def body() -> None:
        async with router(tiny_model_path, [worker], mode="colocated") as client:
            req = {"model": "tiny-v2", "input": "Weather?", "tools": [TOOL],
                   "tool_choice": {"type": "function", "name": "get_weather"},
                   "max_output_tokens": len(worker.tokens)}  # fmt: skip
            whole = await (await client.post("/v1/responses", json=req)).json()
            [call] = whole["output"]
            assert (call["type"], call["name"], json.loads(call["arguments"])) == (
                "function_call", "get_weather", {"city": "Tokyo"})  # fmt: skip
            assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
            assert whole["tool_choice"] == {"type": "function", "name": "get_weather"}
            assert worker.samplings[0].grammar is not None

            raw = await (await client.post("/v1/responses", json={**req, "stream": True})).read()
            stream = events(raw)
            kinds = [e["type"] for e in stream]
            assert kinds[2] == "response.output_item.added"
            assert (
                stream[2]["item"]["arguments"] == "" and stream[2]["item"]["name"] == "get_weather"
            )
            args = [
                e["delta"] for e in stream if e["type"] == "response.function_call_arguments.delta"
            ]
            done = next(e for e in stream if e["type"] == "response.function_call_arguments.done")
            assert "".join(args) == done["arguments"] == call["arguments"]
            assert kinds[-2:] == ["response.output_item.done", "response.completed"]
            assert same_but_ids(stream[-1]["response"], whole)

    run(body)


def test_previous_response_id_continues_with_the_store_only(
    tiny_model_path: Path, tokenizer: Tokenizer
) -> None:
    worker = emitting(tokenizer, CALL)

    async def body() -> None:
        async with router(tiny_model_path, [worker], mode="colocated",
                          enable_store=True) as client:  # fmt: skip
            first = await (await client.post("/v1/responses", json={
                "model": "tiny-v2", "input": "Weather in Tokyo?", "tools": [TOOL],
                "tool_choice": "required", "max_output_tokens": len(worker.tokens)})).json()  # fmt: skip
            call_id = first["output"][0]["call_id"]
            got = await client.get(f"/v1/responses/{first['id']}")
            assert got.status == 200 and (await got.json())["id"] == first["id"]
            second = await client.post("/v1/responses", json={
                "model": "tiny-v2", "previous_response_id": first["id"], "max_output_tokens": 3,
                "input": [{"type": "function_call_output", "call_id": call_id,
                           "output": "rainy"}]})  # fmt: skip
            assert second.status == 200, await second.json()
            prompt = tokenizer.decode(worker.bodies[-1].prompt_token_ids)  # type: ignore[union-attr]
            assert "Weather in Tokyo?" in prompt and '"city": "Tokyo"' in prompt
            assert prompt.index("rainy") > prompt.index('"city": "Tokyo"')
            missing = await client.get("/v1/responses/resp_nope")
            assert missing.status == 404

        async with router(tiny_model_path, [worker], mode="colocated") as client:
            resp = await client.post("/v1/responses", json={
                "model": "tiny-v2", "input": "x", "previous_response_id": first["id"]})  # fmt: skip
            data = await resp.json()
            assert resp.status == 400 and data["error"]["param"] == "previous_response_id"
            assert "--enable-store" in data["error"]["message"]

    run(body)


@pytest.mark.parametrize(
    ("patch", "param", "says"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools", "tools"),
        ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
         "input", "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{"}]},
         "input", "input[0].arguments: not valid JSON"),
        ({"background": True}, "background", "foreground"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "not a reasoning model"),
        ({"max_output_tokens": 100000}, "max_output_tokens", "max_output_tokens"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/no"}}}},
         "text", "text"),
        ({"surprise": 1}, "surprise", "surprise"),
        ({"model": "gpt-9"}, "model", "gpt-9"),
    ],
)  # fmt: skip
def test_malformed_requests_are_refused_by_field(
    tiny_model_path: Path, patch: dict[str, Any], param: str, says: str
) -> None:
    worker = FakeWorker("both", [300])

    async def body() -> None:
        async with router(tiny_model_path, [worker], mode="colocated") as client:
            req = {"model": "tiny-v2", "input": "hi", **patch}
            resp = await client.post("/v1/responses", json=req)
            data = await resp.json()
            assert resp.status == 400, data
            assert data["error"]["param"] == param and says in data["error"]["message"], data
            assert worker.samplings == []

    run(body)
