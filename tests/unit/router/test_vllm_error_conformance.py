"""vLLM's error contracts (issue 33), on fake workers, colocated and disaggregated: each test
names the test of tests/entrypoints/openai/chat_completion/test_chat_error.py or
completion/test_completion_error.py whose contract it re-expresses (our own tests, not
copies). vLLM's tests drive a mocked engine whose output ends with finish_reason "error";
here a fake worker ends its token stream with an engine error event, which is what a pdserve
worker sends when its engine fails a request.

Deliberate differences (README, "The OpenAI API"): an engine failure is a 503 with Retry-After,
never vLLM's 500 (a 500 is a router bug; a worker fault is worth a retry, and the router has
already tried what its recovery table allows), and its message names the engine's error
type where vLLM writes "Internal server error" (never a worker's address); content parts other than text are a 400
naming `messages` where vLLM takes them (a multimodal model) or logs a warning (a system
message): pdserve serves text models, and dropping an image would answer another question.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from router_harness import completion, router, run
from vllm_cases import MODES, chat, workers

from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.worker_api import GenerateRequest
from pdserve.router.api import sse
from pdserve.router.config import RecoveryConfig

# The failing cases' routers: a request with no worker left fails at once, not after the
# default 5 s in the capacity queue.
SHORT_QUEUE = RecoveryConfig(queue_timeout_s=0.1)
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ENDPOINTS = pytest.mark.parametrize(
    ("path", "body"), [(CHAT, chat()), (COMPLETIONS, completion())], ids=["chat", "completion"]
)


def failing(mode: str, after_tokens: int) -> list[Any]:
    """`mode`'s fake workers, each failing every request after `after_tokens` tokens."""
    fakes = workers(mode)
    for fake in fakes:
        fake.error_after_tokens = after_tokens
    return fakes


def assert_released(fakes: list[Any]) -> None:
    """No worker holds anything for a request that failed."""
    assert all(not f.reserved and f.num_active == 0 for f in fakes), fakes


def assert_internal_addresses_kept(fakes: list[Any], message: str) -> None:
    """A client's error text names no worker address (they stay inside the cluster)."""
    for fake in fakes:
        assert fake.url.split("://")[1] not in message, message


@MODES
@ENDPOINTS
def test_engine_error_not_streamed(
    tiny_model_path: Path, mode: str, path: str, body: dict[str, Any]
) -> None:
    """test_chat_error_non_stream / test_completion_error_non_stream: an engine that fails
    the request (finish_reason "error") is an error response, not a 200 with an empty answer.
    vLLM: 500 InternalServerError; pdserve (deliberately): 503 + Retry-After, OpenAI's error
    body with type "server_error", the message naming the engine's error."""
    fakes = failing(mode, 0)

    async def run_case() -> None:
        async with router(tiny_model_path, fakes, mode=mode, recovery=SHORT_QUEUE) as client:
            resp = await client.post(path, json=body)
            data = await resp.json()
            assert resp.status == 503, data
            assert resp.headers["Retry-After"]
            assert set(data) == {"error"} and data["error"]["type"] == "server_error"
            assert set(data["error"]) == {"message", "type", "param", "code"}
            if mode == "colocated":  # disaggregated: the migration that then found no worker
                assert "EngineError: engine step failed" in data["error"]["message"], data
            assert_internal_addresses_kept(fakes, data["error"]["message"])
            assert_released(fakes)

    run(run_case)


@MODES
@ENDPOINTS
def test_engine_error_mid_stream(
    tiny_model_path: Path, mode: str, path: str, body: dict[str, Any]
) -> None:
    """test_chat_error_stream / test_completion_error_stream: a stream whose engine fails
    after a first token ("Hello") has at least two events, one of them the error, and ends
    with `data: [DONE]`. vLLM's error says "Internal server error"; pdserve's is OpenAI's
    error body (type "server_error") naming what failed. The token sent before the failure
    stays sent, once."""
    fakes = failing(mode, 1)
    tokenizer = Tokenizer(tiny_model_path)

    async def run_case() -> None:
        async with router(tiny_model_path, fakes, mode=mode, recovery=SHORT_QUEUE) as client:
            resp = await client.post(path, json={**body, "stream": True})
            assert resp.status == 200
            raw = await resp.read()
            chunks = sse.parse_events(raw)
            assert len(chunks) >= 2
            assert raw.endswith(sse.DONE) and chunks[-1] == "[DONE]"
            decoded = [json.loads(c) for c in chunks[:-1]]
            errors = [c["error"] for c in decoded if "error" in c]
            assert len(errors) == 1 and decoded[-1].get("error") == errors[0], decoded
            assert errors[0]["type"] == "server_error" and errors[0]["message"], errors
            assert_internal_addresses_kept(fakes, errors[0]["message"])
            texts = [
                ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                for c in decoded[:-1]
                for ch in c["choices"]
            ]
            # One token per worker before the failure: colocated one, disaggregated the
            # prefill's first and the decode worker's first.
            sent = workers(mode)[0].tokens[: 1 if mode == "colocated" else 2]
            assert "".join(texts) == tokenizer.decode(sent), texts
            assert_released(fakes)

    run(run_case)


@pytest.mark.parametrize(
    "content",
    [
        # test_system_message_warns_on_image (both forms), _on_audio, _on_video.
        [{"type": "image_url", "image_url": {"url": "https://example.com/image.jpg"}}],
        [{"image_url": {"url": "https://example.com/image.jpg"}}],
        [{"type": "input_audio", "input_audio": {"data": "base64data", "format": "wav"}}],
        [{"input_audio": {"data": "base64data", "format": "wav"}}],
        [{"type": "video_url", "video_url": {"url": "https://example.com/video.mp4"}}],
        [{"video_url": {"url": "https://example.com/video.mp4"}}],
    ],
)
@pytest.mark.parametrize("role", ["system", "user"])
def test_non_text_content_is_a_400(tiny_model_path: Path, content: Any, role: str) -> None:
    """test_system_message_warns_on_image / _audio / _video and
    test_user_message_accepts_image: vLLM takes these parts (a system message's with a
    warning). pdserve (deliberately) refuses them: a 400 naming `messages`, never a 500, no
    worker called."""
    fakes = workers("colocated")

    async def run_case() -> None:
        async with router(tiny_model_path, fakes, mode="colocated") as client:
            messages = [{"role": role, "content": content}]
            resp = await client.post(CHAT, json=chat(messages=messages))
            data = await resp.json()
            assert resp.status == 400, data
            assert data["error"]["param"] == "messages", data
            assert fakes[0].paths() == []

    run(run_case)


@pytest.mark.parametrize(
    "content",
    [
        # test_system_message_accepts_text, test_system_message_accepts_text_array.
        "You are a helpful assistant.",
        [{"type": "text", "text": "You are a helpful assistant."}],
    ],
)
def test_system_message_text_is_taken(tiny_model_path: Path, content: Any) -> None:
    """test_system_message_accepts_text / _accepts_text_array: a system message of text, as a
    string or a list of text parts, is taken, and reaches the chat template."""
    fakes = workers("colocated")
    tokenizer = Tokenizer(tiny_model_path)

    async def run_case() -> None:
        async with router(tiny_model_path, fakes, mode="colocated") as client:
            messages = [{"role": "system", "content": content}, {"role": "user", "content": "hi"}]
            resp = await client.post(CHAT, json=chat(messages=messages))
            assert resp.status == 200, await resp.text()
            sent = fakes[0].bodies[-1]
            assert isinstance(sent, GenerateRequest)
            assert "You are a helpful assistant." in tokenizer.decode(sent.prompt_token_ids)

    run(run_case)


@ENDPOINTS
def test_json_schema_format_without_schema_is_a_400(
    tiny_model_path: Path, path: str, body: dict[str, Any]
) -> None:
    """test_json_schema_response_format_missing_schema (chat and completion): `response_format`
    {"type": "json_schema"} with no `json_schema` is a 400 naming the field, not a 500."""
    fakes = workers("colocated")

    async def run_case() -> None:
        async with router(tiny_model_path, fakes, mode="colocated") as client:
            resp = await client.post(
                path, json={**body, "response_format": {"type": "json_schema"}}
            )
            data = await resp.json()
            assert resp.status == 400, data
            assert data["error"]["param"] == "response_format", data
            assert "json_schema" in data["error"]["message"], data
            assert fakes[0].paths() == []

    run(run_case)


@pytest.mark.parametrize("prompt", [[[-1]], [-1]], ids=["nested", "flat"])
def test_negative_prompt_token_ids_are_a_400(tiny_model_path: Path, prompt: Any) -> None:
    """test_negative_prompt_token_ids_nested / _flat: a prompt of token ids with a negative id
    is a 400 (vLLM: "greater than or equal to 0"; pdserve names the allowed range and the id)."""
    fakes = workers("colocated")

    async def run_case() -> None:
        async with router(tiny_model_path, fakes, mode="colocated") as client:
            resp = await client.post(COMPLETIONS, json=completion(prompt=prompt))
            data = await resp.json()
            assert resp.status == 400, data
            assert data["error"]["param"] == "prompt", data
            assert "[0, " in data["error"]["message"] and "-1" in data["error"]["message"]
            assert fakes[0].paths() == []

    run(run_case)


@MODES
def test_engine_error_in_a_batch_fails_the_batch(tiny_model_path: Path, mode: str) -> None:
    """The batch endpoint (vLLM's chat_completion_full_generator_batch raises on any
    conversation's finish_reason "error"): one failing conversation fails the request, a 503
    here as on /v1/chat/completions, and every conversation's worker request is released."""
    fakes = failing(mode, 0)

    async def run_case() -> None:
        async with router(tiny_model_path, fakes, mode=mode, recovery=SHORT_QUEUE) as client:
            conversations = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
            req = chat(messages=conversations)
            resp = await client.post(f"{CHAT}/batch", json=req)
            data = await resp.json()
            assert resp.status == 503, data
            assert data["error"]["type"] == "server_error"
            assert_released(fakes)

    run(run_case)
