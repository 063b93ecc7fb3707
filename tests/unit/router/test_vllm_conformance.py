"""Where vLLM's OpenAI server and pdserve's must agree (issue 33), on fake workers: each test
names the vLLM test file whose contract it re-expresses (our own tests, not copies)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fake_worker import FakeWorker
from router_harness import completion, router, run

from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.worker_api import GenerateRequest
from pdserve.router.api import sse

TOKENS = [300, 301, 302, 303]


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny-v2", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "temperature": 0, **kw}  # fmt: skip


def events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(e) for e in sse.parse_events(raw)[:-1]]


def test_stream_options_only_with_stream(tiny_model_path: Path) -> None:
    """vLLM test_chat.py / test_completion.py (stream options): `stream_options` on a request
    that does not stream is a 400; with `include_usage` and `continuous_usage_stats` every
    chunk carries the usage so far, the first too; `continuous_usage_stats` alone, none."""
    worker = FakeWorker("both", TOKENS)

    async def body() -> None:
        async with router(tiny_model_path, [worker], mode="colocated") as client:
            for path, req in (("/v1/chat/completions", chat()), ("/v1/completions", completion())):
                resp = await client.post(
                    path, json={**req, "stream_options": {"include_usage": True}}
                )
                data = await resp.json()
                assert resp.status == 400 and data["error"]["param"] == "stream_options", data
            both = {"include_usage": True, "continuous_usage_stats": True}
            resp = await client.post("/v1/chat/completions",
                                     json=chat(stream=True, stream_options=both))  # fmt: skip
            chunks = events(await resp.read())
            assert all(c["usage"] is not None for c in chunks), chunks
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            alone = {"include_usage": False, "continuous_usage_stats": True}
            resp = await client.post("/v1/chat/completions",
                                     json=chat(stream=True, stream_options=alone))  # fmt: skip
            assert all(c.get("usage") is None for c in events(await resp.read()))

    run(body)


def test_custom_roles_and_extra_message_keys_reach_the_template(tiny_model_path: Path) -> None:
    """vLLM test_chat.py (custom role, extra fields): a message with a role of its own, or a
    key the API does not know, is taken and rendered by the chat template."""
    worker = FakeWorker("both", TOKENS)
    tokenizer = Tokenizer(tiny_model_path)

    async def body() -> None:
        async with router(tiny_model_path, [worker], mode="colocated") as client:
            messages = [{"role": "critic", "content": "too short", "mood": "grumpy"},
                        {"role": "user", "content": "hi"}]  # fmt: skip
            resp = await client.post("/v1/chat/completions", json=chat(messages=messages))
            assert resp.status == 200, await resp.text()
            sent = worker.bodies[-1]
            assert isinstance(sent, GenerateRequest)
            assert "<|critic|>\ntoo short" in tokenizer.decode(sent.prompt_token_ids)

    run(body)


def test_continue_final_message(tiny_model_path: Path) -> None:
    """vLLM test_chat_echo.py (continue_final_message): with `add_generation_prompt` false, the
    prompt ends inside the final assistant message, for the model to continue it; both true
    is a 400 naming the field."""
    worker = FakeWorker("both", TOKENS)
    tokenizer = Tokenizer(tiny_model_path)
    messages = [{"role": "user", "content": "Tell me a story"},
                {"role": "assistant", "content": "Once upon a"}]  # fmt: skip

    async def body() -> None:
        async with router(tiny_model_path, [worker], mode="colocated") as client:
            req = chat(messages=messages, continue_final_message=True,
                       add_generation_prompt=False)  # fmt: skip
            resp = await client.post("/v1/chat/completions", json=req)
            assert resp.status == 200, await resp.text()
            sent = worker.bodies[-1]
            assert isinstance(sent, GenerateRequest)
            assert tokenizer.decode(sent.prompt_token_ids).endswith("<|assistant|>\nOnce upon a")
            resp = await client.post("/v1/chat/completions",
                                     json={**req, "add_generation_prompt": True})  # fmt: skip
            data = await resp.json()
            assert resp.status == 400 and data["error"]["param"] == "continue_final_message"

    run(body)


def workers(mode: str) -> list[FakeWorker]:
    """Fake workers serving `mode`: one `both` worker, or a prefill and a decode worker."""
    if mode == "colocated":
        return [FakeWorker("both", TOKENS)]
    return [FakeWorker("prefill", TOKENS), FakeWorker("decode", TOKENS)]


MODES = pytest.mark.parametrize("mode", ["colocated", "disagg"])


@MODES
def test_reply_role_follows_add_generation_prompt(tiny_model_path: Path, mode: str) -> None:
    """vLLM test_chat.py (test_single_chat_session: `message.role == "assistant"`;
    test_chat_streaming: the first delta's role) and serving_chat's get_chat_request_role:
    the answer's role is "assistant" when the prompt opens an assistant turn, else the final
    message's role, whole and streamed, colocated and disaggregated alike."""
    messages = [{"role": "user", "content": "hi"}, {"role": "critic", "content": "too"}]

    async def body() -> None:
        async with router(tiny_model_path, workers(mode), mode=mode) as client:
            for add_gen, role in ((True, "assistant"), (False, "critic")):
                req = chat(messages=messages, add_generation_prompt=add_gen)
                resp = await client.post("/v1/chat/completions", json=req)
                data = await resp.json()
                assert resp.status == 200, data
                assert data["choices"][0]["message"]["role"] == role
                resp = await client.post("/v1/chat/completions", json={**req, "stream": True})
                chunks = events(await resp.read())
                assert chunks[0]["choices"][0]["delta"]["role"] == role
                assert all(c["choices"][0]["delta"].get("role") is None for c in chunks[1:])

    run(body)


def test_tokenizer_info_as_vllm_answers(tiny_model_path: Path) -> None:
    """vLLM test_tokenization.py: test_tokenizer_info_basic (a non-empty `tokenizer_class`),
    test_tokenizer_info_schema (each field's JSON type), test_tokenizer_info_added_tokens_
    structure (ids as strings, each with `content` and a boolean `special`),
    test_tokenizer_info_consistency_with_tokenize (`model_max_length` >= /tokenize's
    `max_model_len`), test_tokenizer_info_chat_template (a non-empty template string: the one
    the router applies, a --chat-template override included). Off by default, as vLLM's
    `--enable-tokenizer-info-endpoint`: then a 404."""
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
    tokenizer = Tokenizer(tiny_model_path)

    async def body() -> None:
        async with router(tiny_model_path, workers("colocated"), mode="colocated") as client:
            assert (await client.get("/tokenizer_info")).status == 404
        async with router(tiny_model_path, workers("colocated"), mode="colocated",
                          enable_tokenizer_info_endpoint=True) as client:  # fmt: skip
            resp = await client.get("/tokenizer_info")
            info = await resp.json()
            assert resp.status == 200, info
            assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
            types = {"add_bos_token": bool, "bos_token": str, "eos_token": str,
                     "chat_template": str, "model_max_length": int,
                     "added_tokens_decoder": dict}  # fmt: skip
            for key, kind in types.items():
                assert isinstance(info[key], kind), (key, info[key])
            added = info["added_tokens_decoder"]
            assert added and all(isinstance(v["special"], bool) and v["content"]
                                 for v in added.values())  # fmt: skip
            assert added[str(tokenizer.bos_token_id)]["content"] == tokenizer.bos_token
            tokenized = await (await client.post("/tokenize", json={"prompt": "Hi!"})).json()
            assert info["model_max_length"] >= tokenized["max_model_len"]
            assert info["chat_template"] == tokenizer.chat_template
        async with router(tiny_model_path, workers("colocated"), mode="colocated",
                          enable_tokenizer_info_endpoint=True,
                          chat_template=template) as client:  # fmt: skip
            info = await (await client.get("/tokenizer_info")).json()
            assert info["chat_template"] == template

    run(body)


@MODES
def test_prompt_logprobs_in_chat(tiny_model_path: Path, mode: str) -> None:
    """vLLM test_chat.py::test_prompt_logprobs_chat: with `prompt_logprobs` 0 or 1 the
    response carries `prompt_logprobs` (one entry per prompt token, the first None, each with
    the prompt's own token), without it none; -1 is a 400 naming the field; and (vLLM's
    ChatCompletionRequest validator) `prompt_logprobs` with `stream` is a 400. Colocated and
    disaggregated alike (the prefill worker computes them)."""
    tokenizer = Tokenizer(tiny_model_path)

    async def body() -> None:
        async with router(tiny_model_path, workers(mode), mode=mode) as client:
            ids = tokenizer.encode_chat([{"role": "user", "content": "hi"}], True)
            for asked in (0, 1):
                resp = await client.post("/v1/chat/completions", json=chat(prompt_logprobs=asked))
                data = await resp.json()
                assert resp.status == 200, data
                lps = data["prompt_logprobs"]
                assert len(lps) == len(ids) and lps[0] is None
                for token_id, position in zip(ids[1:], lps[1:], strict=True):
                    own = position[str(token_id)]
                    assert own["logprob"] == -0.5 and own["decoded_token"] is not None
            data = await (await client.post("/v1/chat/completions", json=chat())).json()
            assert "prompt_logprobs" not in data
            for bad in (chat(prompt_logprobs=-1), chat(prompt_logprobs=1, stream=True)):
                resp = await client.post("/v1/chat/completions", json=bad)
                error = (await resp.json())["error"]
                assert resp.status == 400 and error["param"] == "prompt_logprobs", error

    run(body)


@MODES
def test_echo_only_echoes_the_answers_own_turn(tiny_model_path: Path, mode: str) -> None:
    """vLLM test_batched_chat_completions.py::test_batched_echo_does_not_prepend_user_prompt
    and ::test_batched_echo_prepends_matching_assistant_prefix (the same rule as its single
    chat): with `echo` and add_generation_prompt, the final user message is not echoed; a
    final assistant message being continued is."""
    tokenizer = Tokenizer(tiny_model_path)
    answer = tokenizer.decode(TOKENS)

    async def body() -> None:
        async with router(tiny_model_path, workers(mode), mode=mode) as client:
            user = [{"role": "user", "content": "USER PROMPT"}]
            data = await (
                await client.post("/v1/chat/completions", json=chat(messages=user, echo=True))
            ).json()
            assert data["choices"][0]["message"]["content"] == answer
            prefix = [*user, {"role": "assistant", "content": "PREFIX "}]
            req = chat(messages=prefix, echo=True, add_generation_prompt=False,
                       continue_final_message=True)  # fmt: skip
            data = await (await client.post("/v1/chat/completions", json=req)).json()
            assert data["choices"][0]["message"]["content"] == "PREFIX " + answer

    run(body)
