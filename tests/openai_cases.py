"""Requests exercising every sampling and output feature, sent with the official `openai`
client, and their outcome in a comparable form (text, each token's logprob and alternatives,
finish reason), for tests that compare colocated, disaggregated, re-prefilled and migrated
runs. Logprobs are compared as floats parsed from JSON: equal only if the worker's float32
values were equal bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import openai

MODEL = "tiny-v2"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ada", "bob", "cy"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}

# Two tools whose arguments a random model can finish (enums, a bounded integer, a boolean).
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Tokyo", "Lima"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "convert",
            "parameters": {
                "type": "object",
                "properties": {"unit": {"enum": ["C", "F"]}, "round": {"type": "boolean"}},
                "required": ["unit", "round"],
                "additionalProperties": False,
            },
        },
    },
]
SAYING = "Here is a common saying about apple. An apple a day, keeps"
EARLIER_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Lima", "days": 2}'},
}

# (kind, keyword arguments of client.<kind>.create); extra_body carries vLLM's extensions.
# Tokens whose logprobs the `chat-token-ids` case asks for at every position.
LOGPROB_TOKEN_IDS = [100, 1000, 2000]
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "greedy-penalties-echo": (
        "completion",
        {
            "prompt": "Once upon a time there was",
            "max_tokens": 24,
            "temperature": 0,
            "logprobs": 5,
            "echo": True,
            "presence_penalty": 0.7,
            "frequency_penalty": 0.4,
            "logit_bias": {"50": 3.0, "51": -100},
            "extra_body": {"repetition_penalty": 1.3, "min_tokens": 20, "ignore_eos": True},
        },
    ),
    "seeded-n2-minp": (
        "completion",
        {
            "prompt": ["The quick brown fox", "A long way from home"],
            "max_tokens": 20,
            "temperature": 0.9,
            "top_p": 0.95,
            "seed": 1234,
            "n": 2,
            "logprobs": 2,
            "extra_body": {"min_p": 0.02, "top_k": 50, "ignore_eos": True},
        },
    ),
    "json-schema": (
        "chat",
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Describe a person"}]}
            ],
            "max_tokens": 60,
            "temperature": 1.0,
            "seed": 7,
            "logprobs": True,
            "top_logprobs": 3,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA},
            },
            "frequency_penalty": 0.2,
        },
    ),
    "guided-choice": (
        "chat",
        {
            "messages": [{"role": "user", "content": "yes or no?"}],
            "max_tokens": 10,
            "temperature": 0.7,
            "seed": 3,
            "logprobs": True,
            "extra_body": {"guided_choice": ["absolutely yes", "certainly not"]},
        },
    ),
    # vLLM test_chat_echo.py: echo of the continued final message (see check_valid).
    "chat-echo-continue": (
        "chat",
        {
            "messages": [
                {"role": "user", "content": "tell me a common saying"},
                {"role": "assistant", "content": SAYING},
            ],
            "max_tokens": 20,
            "temperature": 0.8,
            "seed": 9,
            "logprobs": True,
            "top_logprobs": 2,
            "extra_body": {
                "echo": True,
                "continue_final_message": True,
                "add_generation_prompt": False,
                "ignore_eos": True,
            },
        },
    ),
    # vLLM test_return_tokens_as_ids.py: every logprob token and alternative is named
    # `token_id:N` (an emoji the tokenizer splits into byte tokens included); with vLLM's
    # `logprob_token_ids` the alternatives are the chosen token and those.
    "chat-token-ids": (
        "chat",
        {
            "messages": [{"role": "user", "content": "Say \U0001f389 twice"}],
            "max_tokens": 24,
            "temperature": 0.9,
            "seed": 21,
            "logprobs": True,
            "top_logprobs": 2,
            "extra_body": {
                "return_tokens_as_token_ids": True,
                "logprob_token_ids": LOGPROB_TOKEN_IDS,
                "ignore_eos": True,
            },
        },
    ),
    "tool-required": (
        "chat",
        {
            "messages": [{"role": "user", "content": "Weather in Paris, in F?"}],
            "tools": TOOLS,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 80,
            "temperature": 0.8,
            "seed": 11,
            "logprobs": True,
        },
    ),
    "tool-named-after-a-result": (
        "chat",
        {
            "messages": [
                {"role": "user", "content": "Weather in Lima?"},
                {"role": "assistant", "content": None, "tool_calls": [EARLIER_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
                {"role": "user", "content": "And in F?"},
            ],
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "convert"}},
            "max_tokens": 80,
            "temperature": 1.0,
            "seed": 5,
            "logprobs": True,
        },
    ),
}


@dataclass(frozen=True, slots=True)
class Outcome:
    """One choice as the client saw it."""

    index: int
    text: str
    finish_reason: str | None
    # Per token: (token text, logprob, sorted alternatives) — from the logprobs object.
    logprobs: tuple[tuple[str, float | None, tuple[tuple[str, float], ...]], ...]
    # Chat: each tool call's (function name, arguments); ids are random and left out.
    tool_calls: tuple[tuple[str, str], ...] = ()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _completion_logprobs(lp: Any) -> tuple[Any, ...]:
    if lp is None:
        return ()
    tops = lp.top_logprobs or [None] * len(lp.tokens)
    return tuple(
        (tok, value, tuple(sorted((top or {}).items())))
        for tok, value, top in zip(lp.tokens, lp.token_logprobs, tops, strict=True)
    )


def _chat_logprobs(lp: Any) -> tuple[Any, ...]:
    if lp is None or lp.content is None:
        return ()
    return tuple(
        (c.token, c.logprob, tuple(sorted((t.token, t.logprob) for t in c.top_logprobs)))
        for c in lp.content
    )


def run_case(
    url: str, name: str, stream: bool, on_chunk: Callable[[int], None] | None = None
) -> list[Outcome]:
    """Send case `name` (streamed or not) and return its choices in index order."""
    kind, kwargs = CASES[name]
    api = client(url)
    create = api.completions.create if kind == "completion" else api.chat.completions.create
    if not stream:
        resp = create(model=MODEL, **kwargs)
        out = []
        for c in resp.choices:
            if kind == "completion":
                out.append(
                    Outcome(c.index, c.text, c.finish_reason, _completion_logprobs(c.logprobs))
                )
            else:
                calls = tuple((t.function.name, t.function.arguments)
                              for t in c.message.tool_calls or [])  # fmt: skip
                out.append(Outcome(c.index, c.message.content or "", c.finish_reason,
                                   _chat_logprobs(c.logprobs), calls))  # fmt: skip
        return sorted(out, key=lambda o: o.index)
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    lps: dict[int, list[Any]] = {}
    calls: dict[int, list[list[str]]] = {}
    for n, chunk in enumerate(create(model=MODEL, stream=True, **kwargs)):
        for c in chunk.choices:
            texts.setdefault(c.index, "")
            lps.setdefault(c.index, [])
            if kind == "completion":
                texts[c.index] += c.text
                lps[c.index] += _completion_logprobs(c.logprobs)
            else:
                texts[c.index] += c.delta.content or ""
                lps[c.index] += _chat_logprobs(c.logprobs)
                for piece in c.delta.tool_calls or []:
                    own = calls.setdefault(c.index, [])
                    if piece.id is not None:  # a call's first piece: its id and whole name
                        assert piece.index == len(own) and piece.type == "function"
                        own.append([piece.function.name, ""])
                    own[piece.index][1] += piece.function.arguments or ""
            finish[c.index] = c.finish_reason or finish.get(c.index)
        if on_chunk is not None:
            on_chunk(n)
    return [
        Outcome(i, texts[i], finish.get(i), tuple(lps[i]),
                tuple((n, a) for n, a in calls.get(i, [])))
        for i in sorted(texts)
    ]  # fmt: skip


def check_valid(name: str, outcomes: list[Outcome]) -> None:
    """What each case promises whatever path served it."""
    for o in outcomes:
        if name.startswith("tool-"):
            # Forced calls: exactly one (parallel off, or named), valid under its schema.
            assert o.finish_reason == "tool_calls" and o.text == "" and len(o.tool_calls) == 1, o
            function, arguments = o.tool_calls[0]
            args = json.loads(arguments)
            if function == "get_weather":
                assert args["city"] in ("Paris", "Tokyo", "Lima") and 1 <= args["days"] <= 7
            else:
                assert args["unit"] in ("C", "F") and isinstance(args["round"], bool)
            if name == "tool-named-after-a-result":
                assert function == "convert"
            assert o.logprobs, "every case asks for logprobs"
            continue
        assert o.finish_reason in ("stop", "length"), o
        if name == "json-schema":
            value = json.loads(o.text)
            assert value["name"] in ("ada", "bob", "cy") and 0 <= value["age"] <= 99
        if name == "chat-echo-continue":
            assert o.text.startswith(SAYING) and len(o.text) > len(SAYING), o.text
        if name == "guided-choice":
            assert o.text in ("absolutely yes", "certainly not"), o.text
        if name == "chat-token-ids":
            names = [t for t, _, tops in o.logprobs for t in (t, *(a for a, _ in tops))]
            assert all(n.startswith("token_id:") and n[9:].isdigit() for n in names), names
            asked = {f"token_id:{t}" for t in LOGPROB_TOKEN_IDS}
            assert all({a for a, _ in tops} == {t} | asked for t, _, tops in o.logprobs), o
        assert o.logprobs, "every case asks for logprobs"
