"""Tool calling on /v1/chat/completions through the router, on fake workers that emit a
chosen output: OpenAI's shapes whole and streamed (the same calls either way), forced choices
sent to the worker as a grammar, the tools rendered into the prompt, a migration mid-arguments,
and every malformed request refused with a 400 naming its field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fake_worker import FakeWorker
from openai_cases import TOOLS
from router_harness import router, run

from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling import GrammarKind
from pdserve.protocol.worker_api import GenerateRequest
from pdserve.router.api import sse

WEATHER = TOOLS[0]  # get_weather(city, days), described "Weather in a city"
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
OUTPUT = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"q": "rain"}}\n</tool_call>'
)


@pytest.fixture
def tokenizer(tiny_model_path: Path) -> Tokenizer:
    return Tokenizer(tiny_model_path)


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny-v2", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "temperature": 0, "tools": [WEATHER, SEARCH], **kw}  # fmt: skip


def emitting(tokenizer: Tokenizer, text: str, role: str = "both", **kw: Any) -> FakeWorker:
    """A fake worker whose output is `text` then an EOS (`max_tokens` = len(tokens))."""
    tokens = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_ids[0]]
    return FakeWorker(role, tokens, finish_reason="stop", **kw)


def streamed_calls(events: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], str | None]:
    """Content, calls and finish reason put together from streamed chat chunks."""
    content, calls, finish = "", [], None
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for piece in delta.get("tool_calls") or []:
                if "id" in piece:
                    assert piece["index"] == len(calls) and piece["type"] == "function"
                    calls.append({"id": piece["id"], "type": "function",
                                  "function": {"name": piece["function"]["name"],
                                               "arguments": piece["function"]["arguments"]}})  # fmt: skip
                else:
                    assert "name" not in piece["function"]
                    calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return content, calls, finish


def test_auto_calls_come_whole_and_streamed_alike(
    tiny_model_path: Path, tokenizer: Tokenizer
) -> None:
    worker = emitting(tokenizer, OUTPUT)
    n = len(worker.tokens)

    async def body() -> None:
        async with router(tiny_model_path, [worker], mode="colocated") as client:
            resp = await client.post("/v1/chat/completions", json=chat(max_tokens=n))
            data = await resp.json()
            assert resp.status == 200, data
            choice = data["choices"][0]
            assert choice["finish_reason"] == "tool_calls"
            message = choice["message"]
            assert message["content"] == "Checking."
            assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                    for c in message["tool_calls"]] == [
                ("function", "get_weather", {"city": "Paris"}), ("function", "search", {"q": "rain"})
            ]  # fmt: skip
            assert all(c["id"].startswith("call_") for c in message["tool_calls"])

            resp = await client.post("/v1/chat/completions", json=chat(max_tokens=n, stream=True))
            events = [json.loads(e) for e in sse.parse_events(await resp.read())[:-1]]
            content, calls, finish = streamed_calls(events)
            assert (content, finish) == ("Checking.", "tool_calls")
            assert [c["function"] for c in calls] == [c["function"] for c in message["tool_calls"]]
            # The arguments arrive in several pieces, not only once the call is complete.
            pieces = [p for e in events for c in e["choices"]
                      for p in c["delta"].get("tool_calls") or [] if "id" not in p]  # fmt: skip
            assert len(pieces) > 2

    run(body)


def test_tools_reach_the_template_and_a_forced_choice_the_worker(
    tiny_model_path: Path, tokenizer: Tokenizer
) -> None:
    call = '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>'
    worker = emitting(tokenizer, call)
    n = len(worker.tokens)

    async def body() -> None:
        async with router(tiny_model_path, [worker], mode="colocated") as client:
            named = {"type": "function", "function": {"name": "search"}}
            for choice in ("required", named, "none"):
                resp = await client.post(
                    "/v1/chat/completions", json=chat(max_tokens=n, tool_choice=choice)
                )
                data = await resp.json()
                assert resp.status == 200, data
                message = data["choices"][0]["message"]
                if choice == "none":
                    assert message["content"] == call and "tool_calls" not in message
                else:
                    assert message["tool_calls"][0]["function"]["name"] == "search"
            required, forced, free = worker.samplings
            assert free.grammar is None
            assert required.grammar is not None and forced.grammar is not None
            assert required.grammar.kind is forced.grammar.kind is GrammarKind.GRAMMAR
            assert '\\"get_weather\\"' in required.grammar.source
            assert '\\"get_weather\\"' not in forced.grammar.source
            generate = worker.bodies[0]
            assert isinstance(generate, GenerateRequest)
            prompt = tokenizer.decode(generate.prompt_token_ids)
            assert '"name": "get_weather"' in prompt and "Weather in a city" in prompt

    run(body)


def test_a_decode_death_mid_arguments_loses_and_repeats_nothing(
    tiny_model_path: Path, tokenizer: Tokenizer
) -> None:
    prefill = emitting(tokenizer, OUTPUT, role="prefill")
    tokens = prefill.tokens
    # Dies after the first call's name, inside its arguments.
    cut = len(tokenizer.encode(OUTPUT[: OUTPUT.index('"Paris"')], add_special_tokens=False))
    dying = emitting(tokenizer, OUTPUT, role="decode", cut_after_tokens=cut)
    survivor = emitting(tokenizer, OUTPUT, role="decode", num_running=1)

    async def body() -> None:
        async with router(tiny_model_path, [prefill, dying, survivor]) as client:
            req = chat(max_tokens=len(tokens), stream=True)
            resp = await client.post("/v1/chat/completions", json=req)
            events = [json.loads(e) for e in sse.parse_events(await resp.read())[:-1]]
            content, calls, finish = streamed_calls(events)
            assert (content, finish) == ("Checking.", "tool_calls")
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
                ("get_weather", '{"city": "Paris"}'), ("search", '{"q": "rain"}')
            ]  # fmt: skip
            assert ("/generate", req_id(survivor)) in survivor.calls

    run(body)


def req_id(worker: FakeWorker) -> str:
    return next(rid for path, rid in worker.calls if path == "/generate")


BAD_SCHEMA = {"type": "function", "function": {
    "name": "f", "parameters": {"type": "object", "properties": {"x": {"$ref": "#/nope"}}}}}  # fmt: skip
CALL = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("patch", "param", "says"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "'nope', which is not in tools"),
        ({"tools": [BAD_SCHEMA]}, "tools", "tools[0].function.parameters"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "listed twice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", ".name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
         "tools", "type object"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools", "tools"),
        ({"messages": [{"role": "tool", "tool_call_id": "call_9", "content": "42"}]}, "messages",
         "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x"},
                       {"role": "assistant", "tool_calls": [CALL]},
                       {"role": "tool", "tool_call_id": "call_2", "content": "42"}]}, "messages",
         "no earlier assistant message made a call with id 'call_2'"),
        ({"messages": [{"role": "assistant", "tool_calls": [
            {**CALL, "function": {"name": "search", "arguments": "{oops"}}]}]}, "messages",
         "messages[0].tool_calls[0].function.arguments: not valid JSON"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages",
         "only assistant messages carry tool calls"),
        ({"tool_choice": "auto", "guided_regex": "a+"}, "tool_choice",
         "combines with a JSON response_format or guided_json only"),
    ],
)  # fmt: skip
def test_malformed_tool_requests_are_refused_by_field(
    tiny_model_path: Path, patch: dict[str, Any], param: str, says: str
) -> None:
    worker = FakeWorker("both", [300, 301])

    async def body() -> None:
        async with router(tiny_model_path, [worker], mode="colocated") as client:
            resp = await client.post("/v1/chat/completions", json=chat(max_tokens=2, **patch))
            data = await resp.json()
            assert resp.status == 400, data
            assert data["error"]["param"] == param
            assert says in data["error"]["message"]
            assert worker.samplings == []

    run(body)


def test_a_typed_answer_combines_with_tools(tiny_model_path: Path, tokenizer: Tokenizer) -> None:
    """An agent's typed final answer (`response_format`) with tools: a forced choice is calls
    only; `auto` is calls or that JSON; `none` is the JSON alone."""
    worker = emitting(tokenizer, '{"a": 1}')
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}  # fmt: skip

    async def body() -> None:
        async with router(tiny_model_path, [worker], mode="colocated") as client:
            for choice in ("required", "auto", "none"):
                req = chat(max_tokens=len(worker.tokens), tool_choice=choice,
                           response_format=schema)  # fmt: skip
                resp = await client.post("/v1/chat/completions", json=req)
                assert resp.status == 200, await resp.text()
            required, auto, none = (s.grammar for s in worker.samplings)
            assert required is not None and "answer" not in required.source
            assert auto is not None and "answer: %json" in auto.source and "call_0" in auto.source
            assert none is not None and none.kind is GrammarKind.JSON_SCHEMA

    run(body)


def test_tokenize_gives_the_prompt_a_chat_with_tools_runs(tiny_model_path: Path) -> None:
    """A conversation with a call and its result runs, and /tokenize gives its exact prompt."""
    worker = FakeWorker("both", [300, 301])
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]

    async def body() -> None:
        async with router(tiny_model_path, [worker], mode="colocated") as client:
            req = chat(max_tokens=2, messages=messages)
            assert (await client.post("/v1/chat/completions", json=req)).status == 200
            resp = await client.post(
                "/tokenize", json={"model": "tiny-v2", "messages": messages, "tools": req["tools"]}
            )
            generate = worker.bodies[0]
            assert isinstance(generate, GenerateRequest)
            assert (await resp.json())["tokens"] == generate.prompt_token_ids

    run(body)
