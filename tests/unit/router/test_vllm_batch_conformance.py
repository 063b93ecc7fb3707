"""vLLM's POST /v1/chat/completions/batch (issue 33), on fake workers, colocated and
disaggregated: each test names the vLLM test of
tests/entrypoints/openai/chat_completion/test_batched_chat_completions.py (or the
`BatchChatCompletionRequest` rule) whose contract it re-expresses; our own tests, not copies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from router_harness import router, run
from vllm_cases import MODES, TOKENS, workers

from pdserve.model.tokenizer import Tokenizer

BATCH = "/v1/chat/completions/batch"
CONVERSATIONS = [
    [{"role": "user", "content": "Reply with exactly the word: alpha"}],
    [{"role": "user", "content": "Reply with exactly the word: beta"}],
]

# A conversation the chat path refuses (text content only).
IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y"}}]}]

# A conversation longer than the tiny model's context (2048 tokens).
TOO_LONG = [{"role": "user", "content": "x " * 2100}]


def batch(**kw: Any) -> dict[str, Any]:
    """A greedy batch body of two conversations."""
    return {"model": "tiny-v2", "messages": CONVERSATIONS, "max_tokens": 4, "temperature": 0,
            **kw}  # fmt: skip


@MODES
def test_one_choice_per_conversation(tiny_model_path: Path, mode: str) -> None:
    """test_batched_chat_completions: two conversations give a 200 with two choices, indexed
    {0, 1}, each with content. Beyond vLLM's assertions: choice i answers conversation i
    (each ran as its own worker request `<id>-<i>`, with its own prompt), and the usage sums
    both conversations."""
    tokenizer = Tokenizer(tiny_model_path)
    prompts = [tokenizer.encode_chat(c, True) for c in CONVERSATIONS]
    fakes = workers(mode)

    async def body() -> None:
        async with router(tiny_model_path, fakes, mode=mode) as client:
            resp = await client.post(BATCH, json=batch())
            data = await resp.json()
            assert resp.status == 200, data
            assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
            choices = data["choices"]
            assert [c["index"] for c in choices] == [0, 1]
            answer = tokenizer.decode(TOKENS[:4])
            for c in choices:
                assert c["message"] == {"role": "assistant", "content": answer}, c
                assert c["finish_reason"] == "length"
            first = fakes[0]  # the worker that saw each prompt (colocated, or prefill)
            ids = {rid for path, rid in first.calls if path in ("/generate", "/prefill")}
            assert ids == {f"{data['id']}-0", f"{data['id']}-1"}
            usage = data["usage"]
            assert usage["prompt_tokens"] == sum(len(p) for p in prompts)
            assert usage["completion_tokens"] == 8
            assert usage["total_tokens"] == usage["prompt_tokens"] + 8
            assert "prompt_token_ids" not in data

    run(body)


@MODES
def test_structured_output_applies_to_every_conversation(tiny_model_path: Path, mode: str) -> None:
    """test_batched_chat_completions_with_json_schema: a `response_format` json_schema
    constrains each conversation (here: every worker request carries the compiled schema; the
    fake worker's fixed tokens are not JSON, so the parsed answer is checked on real workers
    in tests/integration/test_openai_client.py)."""
    schema = {"type": "object", "properties": {"answer": {"type": "string",
              "enum": ["yes", "no"]}}, "required": ["answer"]}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    fakes = workers(mode)

    async def body() -> None:
        async with router(tiny_model_path, fakes, mode=mode) as client:
            resp = await client.post(BATCH, json=batch(response_format=fmt))
            data = await resp.json()
            assert resp.status == 200, data
            assert len(data["choices"]) == 2
            sent = fakes[0].samplings
            assert len(sent) == 2 and all(s.grammar is not None for s in sent), sent

    run(body)


@MODES
def test_logprobs_are_token_texts(tiny_model_path: Path, mode: str) -> None:
    """test_batched_chat_completions_logprobs_not_token_id_placeholders: with `logprobs`,
    `top_logprobs: 1` and `return_token_ids`, every logprob token (and alternative) is the
    token's text, never a `token_id:N` placeholder; each choice carries its token ids."""
    tokenizer = Tokenizer(tiny_model_path)

    async def body() -> None:
        async with router(tiny_model_path, workers(mode), mode=mode) as client:
            req = batch(messages=CONVERSATIONS[:1], logprobs=True, top_logprobs=1,
                        return_token_ids=True)  # fmt: skip
            resp = await client.post(BATCH, json=req)
            data = await resp.json()
            assert resp.status == 200, data
            choice = data["choices"][0]
            assert choice["token_ids"] == TOKENS[:4]
            content = choice["logprobs"]["content"]
            assert [e["token"] for e in content] == [tokenizer.decode([t]) for t in TOKENS[:4]]
            for entry in content:
                assert not entry["token"].startswith("token_id:")
                assert len(entry["top_logprobs"]) == 1
                assert not entry["top_logprobs"][0]["token"].startswith("token_id:")

    run(body)


@MODES
def test_echo_only_echoes_the_answers_own_turn(tiny_model_path: Path, mode: str) -> None:
    """test_batched_echo_does_not_prepend_user_prompt and
    test_batched_echo_prepends_matching_assistant_prefix: with `echo`, a final user message is
    not echoed; a final assistant message being continued is, per conversation."""
    answer = Tokenizer(tiny_model_path).decode(TOKENS[:4])
    user = [{"role": "user", "content": "USER PROMPT"}]
    prefix = [*user, {"role": "assistant", "content": "PREFIX "}]

    async def body() -> None:
        async with router(tiny_model_path, workers(mode), mode=mode) as client:
            resp = await client.post(BATCH, json=batch(messages=[user], echo=True))
            data = await resp.json()
            assert data["choices"][0]["message"]["content"] == answer, data
            req = batch(messages=[prefix, prefix], echo=True, add_generation_prompt=False,
                        continue_final_message=True)  # fmt: skip
            data = await (await client.post(BATCH, json=req)).json()
            assert [c["message"]["content"] for c in data["choices"]] == ["PREFIX " + answer] * 2

    run(body)


@pytest.mark.parametrize(
    ("patch", "param", "words"),
    [
        # BatchChatCompletionRequest: `messages` is a non-empty list of conversations.
        ({"messages": []}, "messages", "list of conversations"),
        ({"messages": CONVERSATIONS[0]}, "messages", "list of conversations"),
        ({"messages": "hi"}, "messages", "list of conversations"),
        # Its limits (check_batch_mode): no streaming, no tools, n = 1.
        ({"stream": True}, "stream", "answers whole"),
        ({"n": 2}, "n", "one choice per conversation"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
            "tools",
            "tool calling",
        ),
        ({"tool_choice": "required"}, "tool_choice", "tool calling"),
        # pdserve: one response-level prompt_logprobs cannot hold several prompts' (README).
        ({"prompt_logprobs": 1}, "prompt_logprobs", "several prompts"),
        # The chat path's own checks, on each conversation, naming it.
        ({"messages": [CONVERSATIONS[0], IMAGE]}, "messages", "conversation 1"),
        ({"max_tokens": 10**6}, "max_tokens", "conversation 0"),
        ({"messages": [CONVERSATIONS[0], TOO_LONG]}, "messages", "conversation 1: messages"),
        # A field every conversation shares: the batch's error, naming no conversation.
        ({"temprature": 0.5}, "temprature", "temprature: unknown field"),
        ({"temperature": -1}, "temperature", "temperature"),
        ({"model": "other"}, "model", "not served"),
    ],
)
def test_refusals_are_400s_naming_the_field(
    tiny_model_path: Path, patch: dict[str, Any], param: str, words: str
) -> None:
    """What vLLM's batch request model refuses, and the chat path's own 400s, per
    conversation: each a 400 whose `param` names the field, never a 500, no worker called."""
    fakes = workers("colocated")

    async def body() -> None:
        async with router(tiny_model_path, fakes, mode="colocated") as client:
            resp = await client.post(BATCH, json=batch(**patch))
            data = await resp.json()
            assert resp.status == 400, data
            assert data["error"]["param"] == param, data
            assert words in data["error"]["message"], data
            assert fakes[0].paths() == []

    run(body)


def test_harmless_defaults_pass(tiny_model_path: Path) -> None:
    """The limits' default values (`stream: false`, `n: 1`, `tools: []`, `tool_choice:
    "none"`) are taken, as vLLM's validator takes them."""

    async def body() -> None:
        async with router(tiny_model_path, workers("colocated"), mode="colocated") as client:
            req = batch(stream=False, n=1, tools=[], tool_choice="none")
            resp = await client.post(BATCH, json=req)
            assert resp.status == 200, await resp.text()

    run(body)
