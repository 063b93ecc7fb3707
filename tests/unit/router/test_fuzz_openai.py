"""Fuzz: random JSON against the OpenAI request parser and the router's OpenAI endpoints.

What is fuzzed: request bodies for /v1/completions and /v1/chat/completions, built three ways:
a valid body with fields replaced by random JSON (wrong types, huge and negative numbers, NaN and
infinities, nested junk, lone surrogates, long strings), removed, or joined by unknown fields;
arbitrary JSON documents (deeply nested ones included); and raw bytes that are not JSON.
They go to the router's parser (`json_body.read_object`, `field_policy.screen`,
`json_body.validate`) with each request model, and end to end through the router
app in disaggregated mode over fake prefill and decode workers (`router_harness`).

Properties: the parser returns a model or raises `InvalidRequest` naming a top-level field of
the model as its `param` (or no param and code `invalid_json` when the body is not a JSON
object). End to end every body gets 200 with a valid completion (whole, or SSE chunks ending in
`data: [DONE]`) or 400 with an OpenAI error naming the field the same way: never a 5xx, and
never a worker's refusal passed through (the router must not send a worker a body it refuses).
After each request the decode worker soon holds no reservation.

Budget: 200 parser examples, 120 end-to-end examples, fixed seed (`fuzz_support`):
about 2 s of CPU.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
from aiohttp.test_utils import TestClient
from fake_worker import FakeWorker
from fuzz_support import fuzz_settings, json_values, lone_surrogates, long_strings, note
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel
from router_harness import router

from pdserve.errors import InvalidRequest
from pdserve.model.tokenizer import Tokenizer
from pdserve.router.api import field_policy, sse
from pdserve.router.api.json_body import read_object, validate
from pdserve.router.api.openai_models import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
)

REQUEST_TIMEOUT_S = 20.0
RELEASE_TIMEOUT_S = 5.0
ENDPOINTS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}
VALID: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": "tiny-v2", "prompt": "hello", "max_tokens": 2},
    "/v1/chat/completions": {
        "model": "tiny-v2",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    },
}

# ---- field values ------------------------------------------------------------------------------

# Values close to what each field takes, so fuzzing also reaches the checks after parsing.
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["tiny-v2", "other", "", "tiny-v2 "]),
    "prompt": st.one_of(
        st.sampled_from(["", "hi", [], [1, 2], [-1], [2047], [2048], [1, True]]),
        st.lists(st.integers(-5, 3000), max_size=5),
        long_strings,
        lone_surrogates,
    ),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", "bogus"])},
            optional={"content": st.one_of(st.text(max_size=12), lone_surrogates, json_values)},
        ),
        max_size=3,
    ),
    "max_tokens": st.sampled_from([-1, 0, 1, 3, 2047, 2048, 10**20, 1.0, 1.5, "2"]),
    "max_completion_tokens": st.sampled_from([None, -1, 0, 1, 3, 10**20]),
    "temperature": st.sampled_from([0, 0.5, 1e-300, 5e-324, -1, 1e308, "0"]),
    "top_p": st.sampled_from([0, 5e-324, 0.5, 1, 1.5, -1]),
    "top_k": st.sampled_from([-2, -1, 0, 1, 10**20]),
    "seed": st.sampled_from([-1, 0, 2**63 - 1, 2**64 - 1, 2**64, 10**30]),
    "stop": st.one_of(
        st.sampled_from(["", "x", ["a", ""], [1], [], ["\n"] * 20]),
        lone_surrogates,
        st.lists(lone_surrogates, max_size=2),
    ),
    "n": st.sampled_from([0, 1, 2, 10**20]),
    "stream": st.sampled_from([True, False, "true", 1, None]),
    "stream_options": st.sampled_from([None, {}, {"include_usage": True}, {"include_usage": 2}]),
    "ignore_eos": st.sampled_from([True, False, "yes"]),
    "return_token_ids": st.sampled_from([True, False, 0]),
    "user": st.one_of(st.sampled_from(["alice", ""]), lone_surrogates, long_strings),
}


@st.composite
def edited_bodies(draw: st.DrawFn, path: str) -> bytes:
    """A valid body with 1..4 fields replaced (by plausible or random JSON), removed or added."""
    body = dict(VALID[path])
    fields = [name for name in ENDPOINTS[path].model_fields if name in PLAUSIBLE]
    for _ in range(draw(st.integers(1, 4))):
        name = draw(st.sampled_from([*fields, "unknown_field"]))
        action = draw(st.sampled_from(["plausible", "plausible", "random", "remove"]))
        if action == "remove":
            body.pop(name, None)
        elif action == "plausible" and name in PLAUSIBLE:
            body[name] = draw(PLAUSIBLE[name])
        else:
            body[name] = draw(json_values)
    return json.dumps(body).encode()


deep_nesting = st.builds(
    lambda opener, n: (opener * n).encode(), st.sampled_from(["[", '{"a":']),
    st.integers(10, 50_000),
)  # fmt: skip
documents = st.one_of(json_values.map(lambda v: json.dumps(v).encode()), deep_nesting)


def bodies(path: str) -> st.SearchStrategy[bytes]:
    """Every kind of body for `path`, mostly near-valid ones (they reach the most code)."""
    return st.one_of(
        edited_bodies(path), edited_bodies(path), edited_bodies(path), documents,
        st.binary(max_size=64),
    )  # fmt: skip


def field_named(param: str | None, code: str | None, model: type[BaseModel], raw: bytes) -> bool:
    """An error names a top-level field of the request (declared, or an unknown one the body
    has), or says the body is not a JSON object."""
    if param is None:
        return code == "invalid_json"
    if param in model.model_fields:
        return True
    try:
        body = json.loads(raw)
    except ValueError:
        return False
    return isinstance(body, dict) and param in body


# ---- the parser --------------------------------------------------------------------------------


async def _parse(request: Any, model: type[BaseModel]) -> BaseModel:
    """What the router does with a body before it builds a job (unknown fields refused)."""
    kind = "completion" if model is CompletionRequest else "chat"
    data = await read_object(request)
    return validate(model, field_policy.screen(data, model, kind, allow_unknown=False))


@dataclass
class RawRequest:
    """What `_parse` reads from an aiohttp request: its body (sent as JSON)."""

    body: bytes
    headers: ClassVar[dict[str, str]] = {"Content-Type": "application/json"}
    content_type = "application/json"

    async def read(self) -> bytes:
        return self.body


@fuzz_settings(200)
@given(st.sampled_from(sorted(ENDPOINTS)).flatmap(lambda p: st.tuples(st.just(p), bodies(p))))
def test_the_parser_returns_a_model_or_an_invalid_request_naming_the_field(
    case: tuple[str, bytes],
) -> None:
    path, raw = case
    model = ENDPOINTS[path]
    try:
        parsed = asyncio.run(_parse(RawRequest(raw), model))
    except InvalidRequest as exc:
        note(f"refused: param={exc.param} code={exc.code}")
        assert field_named(exc.param, exc.code, model, raw), (exc.param, exc.code, exc.message)
        return
    note("parsed")
    assert isinstance(parsed, model)


# ---- end to end --------------------------------------------------------------------------------


@dataclass
class Cluster:
    """A router over one fake prefill and one fake decode worker, on its own event loop."""

    loop: asyncio.AbstractEventLoop
    client: TestClient
    decode: FakeWorker


@pytest.fixture(scope="module")
def cluster(tiny_model_path: Path) -> Iterator[Cluster]:
    tokens = Tokenizer(tiny_model_path).encode(" the cat sat on the mat", add_special_tokens=False)
    prefill, decode = FakeWorker("prefill", tokens), FakeWorker("decode", tokens)
    loop = asyncio.new_event_loop()
    context = router(tiny_model_path, [prefill, decode])
    client = loop.run_until_complete(context.__aenter__())
    try:
        yield Cluster(loop, client, decode)
    finally:
        loop.run_until_complete(context.__aexit__(None, None, None))
        loop.close()


async def post(client: TestClient, path: str, raw: bytes) -> tuple[int, str]:
    async with asyncio.timeout(REQUEST_TIMEOUT_S):
        resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
        return resp.status, await resp.text()


async def released(decode: FakeWorker) -> None:
    """Wait (bounded) until the decode worker holds no reservation and runs no decode."""
    async with asyncio.timeout(RELEASE_TIMEOUT_S):
        while decode.reserved or decode.num_active:
            await asyncio.sleep(0.005)


def check_success(path: str, text: str) -> None:
    """A whole completion, or SSE chunks (or a final error event) ending in [DONE]."""
    if not text.startswith("data: "):
        response = CompletionResponse if path == "/v1/completions" else ChatCompletionResponse
        response.model_validate_json(text)
        note("200 whole")
        return
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert f"data: {events[-1]}\n\n".encode() == sse.DONE
    chunk = CompletionResponse if path == "/v1/completions" else ChatCompletionChunk
    for data in events[:-1]:
        if '"error"' in data[:10]:
            ErrorResponse.model_validate_json(data)
        else:
            chunk.model_validate_json(data)
    note("200 streamed")


@fuzz_settings(120)
@given(st.sampled_from(sorted(ENDPOINTS)).flatmap(lambda p: st.tuples(st.just(p), bodies(p))))
def test_the_router_answers_every_body_with_a_completion_or_a_400_naming_the_field(
    cluster: Cluster, case: tuple[str, bytes]
) -> None:
    path, raw = case
    status, text = cluster.loop.run_until_complete(post(cluster.client, path, raw))
    # A stream ends for the client before its handler has closed the flow (which releases a
    # reservation the decode never used, e.g. with max_tokens 1): give it a moment.
    cluster.loop.run_until_complete(released(cluster.decode))
    if status == 200:
        check_success(path, text)
    else:
        assert status == 400, (status, text[:300])
        error = ErrorResponse.model_validate_json(text).error
        note(f"400 param={error.param}")
        assert error.type == "invalid_request_error"
        assert field_named(error.param, error.code, ENDPOINTS[path], raw), error


# ---- what the fuzz found -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "raw", "param", "code"),
    [
        # json.loads accepted these; the tokenizer (TypeError) or the JSON encoder of the call
        # to the worker (PydanticSerializationError) then failed with a 500.
        ("/v1/completions", rb'{"model": "tiny-v2", "prompt": "he\ud800llo"}', None,
         "invalid_json"),
        ("/v1/completions", rb'{"model": "tiny-v2", "prompt": "a", "stop": ["\udfff"]}', None,
         "invalid_json"),
        ("/v1/chat/completions",
         rb'{"model": "tiny-v2", "messages": [{"role": "user", "content": "\ud83d"}]}', None,
         "invalid_json"),
        # json.loads raised RecursionError: a 500.
        ("/v1/completions", b"[" * 100_000, None, "invalid_json"),
        ("/v1/chat/completions", b'{"a":' * 100_000, None, "invalid_json"),
        # Accepted and sent to the workers, whose sampler cannot take a seed past 64 bits.
        ("/v1/completions", b'{"model": "tiny-v2", "prompt": "a", "seed": 18446744073709551616}',
         "seed", None),
    ],
    ids=["surrogate-prompt", "surrogate-stop", "surrogate-chat", "deep-array", "deep-object",
         "seed-2**64"],
)  # fmt: skip
def test_bodies_the_fuzz_found_get_a_400(
    cluster: Cluster, path: str, raw: bytes, param: str | None, code: str | None
) -> None:
    status, text = cluster.loop.run_until_complete(post(cluster.client, path, raw))
    assert status == 400, text
    error = ErrorResponse.model_validate_json(text).error
    assert (error.param, error.code) == (param, code), error
