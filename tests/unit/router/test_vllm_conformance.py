"""Where vLLM's OpenAI server and pdserve's must agree (issue 33), on fake workers: each test
names the vLLM test file whose contract it re-expresses (our own tests, not copies)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
