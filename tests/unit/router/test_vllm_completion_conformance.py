"""Where vLLM's /v1/completions (and the chat validation it shares) and pdserve's must agree
(issue 33), on fake workers, colocated and disaggregated: each test names the vLLM test it
re-expresses (tests/entrypoints/openai/completion/test_completion.py, chat_completion/
test_chat.py); our own tests, not copies. The fake worker's script is the same for every
request, so what vLLM checks through a real model's text (distinct samples, valid JSON) is
checked through the request the worker was sent, and across paths in
tests/integration/test_openai_client.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from fake_worker import FakeWorker
from router_harness import completion, router, run

from pdserve.model.tokenizer import Tokenizer
from pdserve.router.api import sse

TOKENS = [300, 301, 302, 303, 304]
MODES = pytest.mark.parametrize("mode", ["colocated", "disagg"])


def workers(mode: str) -> list[FakeWorker]:
    """Fake workers serving `mode`: one `both` worker, or a prefill and a decode worker."""
    if mode == "colocated":
        return [FakeWorker("both", TOKENS)]
    return [FakeWorker("prefill", TOKENS), FakeWorker("decode", TOKENS)]


def events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(e) for e in sse.parse_events(raw)[:-1]]


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny-v2", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "temperature": 0, **kw}  # fmt: skip


@MODES
def test_single_completion_and_logprob_counts(tiny_model_path: Path, mode: str) -> None:
    """test_single_completion (one choice, finish "length", usage adds up, prompt tokens as
    the tokenizer counts them, cached_tokens 0; token-id prompts too), test_no_logprobs /
    test_zero_logprobs / test_some_logprobs (no logprobs object; with 0 one entry per
    position: the chosen token; with N, N or N + 1 entries)."""
    tokenizer = Tokenizer(tiny_model_path)

    async def body() -> None:
        async with router(tiny_model_path, workers(mode), mode=mode) as client:
            prompt = "Hello, my name is"
            data = await (
                await client.post("/v1/completions", json=completion(5, prompt=prompt))
            ).json()
            assert data["id"] and len(data["choices"]) == 1
            assert data["choices"][0]["finish_reason"] == "length"
            usage = data["usage"]
            assert usage["completion_tokens"] == 5
            assert usage["prompt_tokens"] == len(tokenizer.encode(prompt))
            assert usage["total_tokens"] == usage["prompt_tokens"] + 5
            assert usage["prompt_tokens_details"]["cached_tokens"] == 0
            ids = await (
                await client.post("/v1/completions", json=completion(5, prompt=[0, 0, 0, 0, 0]))
            ).json()
            assert ids["choices"][0]["text"] and ids["usage"]["prompt_tokens"] == 5
            assert ids["choices"][0]["logprobs"] is None
            for asked, sizes in ((0, {1}), (2, {2, 3})):
                req = completion(5, prompt=[0, 0, 0, 0, 0], logprobs=asked)
                lp = (await (await client.post("/v1/completions", json=req)).json())["choices"][0][
                    "logprobs"
                ]
                assert lp["token_logprobs"] and {len(t) for t in lp["top_logprobs"]} <= sizes

    run(body)


@MODES
def test_batch_completions(tiny_model_path: Path, mode: str) -> None:
    """test_batch_completions: a list of two prompts (text, or token ids) gives two choices
    with the same greedy text; with n = 2 four, in prompt-major order (choice 2 is prompt 1's
    first sample, the same as choice 0); streamed, each chunk carries one choice and the
    texts agree. (vLLM's n = 2 there needs `use_beam_search`; pdserve samples n
    independently, so its greedy samples are equal, see README.)"""

    async def body() -> None:
        async with router(tiny_model_path, workers(mode), mode=mode) as client:
            for prompts in (["Hello, my name is"] * 2, [[0, 0, 0, 0, 0]] * 2):
                data = await (
                    await client.post("/v1/completions", json=completion(5, prompt=prompts))
                ).json()
                texts = [c["text"] for c in data["choices"]]
                assert len(texts) == 2 and texts[0] == texts[1]
                data = await (
                    await client.post("/v1/completions", json=completion(5, prompt=prompts, n=2))
                ).json()
                assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
                assert data["choices"][0]["text"] == data["choices"][2]["text"]
                assert data["choices"][1]["text"] == data["choices"][3]["text"]
                resp = await client.post(
                    "/v1/completions", json=completion(5, prompt=prompts, stream=True)
                )
                streamed = ["", ""]
                for chunk in events(await resp.read()):
                    assert len(chunk["choices"]) == 1
                    streamed[chunk["choices"][0]["index"]] += chunk["choices"][0]["text"]
                assert streamed[0] == streamed[1] == texts[0]

    run(body)


@MODES
def test_parallel_sampling(tiny_model_path: Path, mode: str) -> None:
    """test_parallel_no_streaming / test_parallel_streaming (and test_chat.py's
    test_chat_completion_n_parameter_*): n = 3 gives choices 0, 1, 2 each with a finish
    reason and its logprobs; streamed, one finish reason per choice and no choice longer than
    max_tokens. Each sample has its own seed (vLLM's distinct samples)."""

    served = workers(mode)

    async def body() -> None:
        async with router(tiny_model_path, served, mode=mode) as client:
            req = completion(5, prompt="What is an LLM?", n=3, temperature=1.0, seed=42,
                             logprobs=0)  # fmt: skip
            data = await (await client.post("/v1/completions", json=req)).json()
            assert [c["index"] for c in data["choices"]] == [0, 1, 2]
            assert all(c["finish_reason"] and c["logprobs"]["tokens"] for c in data["choices"])
            assert len({s.seed for w in served for s in w.samplings}) == 3
            resp = await client.post("/v1/completions", json={**req, "stream": True})
            finished: dict[int, int] = {}
            lengths: dict[int, int] = {}
            for chunk in events(await resp.read()):
                choice = chunk["choices"][0]
                lengths[choice["index"]] = lengths.get(choice["index"], 0) + 1
                if choice["finish_reason"] is not None:
                    finished[choice["index"]] = finished.get(choice["index"], 0) + 1
            assert finished == {0: 1, 1: 1, 2: 1} and max(lengths.values()) <= 5
            resp = await client.post("/v1/chat/completions", json=chat(n=3, temperature=0.7))
            choices = (await resp.json())["choices"]
            assert [c["index"] for c in choices] == [0, 1, 2]
            assert all(c["message"]["content"] for c in choices)

    run(body)


@MODES
def test_echo_logprob_completion(tiny_model_path: Path, mode: str) -> None:
    """test_echo_logprob_completion (logprobs 0 and 1, text and token-id prompts): the text
    starts with the prompt; the prompt's first position has no logprob and no alternatives;
    every other position has between max(N, 1) and N + 1 entries."""
    tokenizer = Tokenizer(tiny_model_path)

    async def body() -> None:
        async with router(tiny_model_path, workers(mode), mode=mode) as client:
            for asked in (1, 0):
                for prompt in ("Hello, my name is", [5, 6, 7, 8, 9]):
                    req = completion(5, prompt=prompt, echo=True, logprobs=asked)
                    choice = (await (await client.post("/v1/completions", json=req)).json())[
                        "choices"
                    ][0]
                    text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
                    assert choice["text"].startswith(text)
                    lp = choice["logprobs"]
                    assert len(lp["tokens"]) > 5 and len(lp["text_offset"]) > 5
                    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
                    assert all(max(asked, 1) <= len(t) <= asked + 1 for t in lp["top_logprobs"][1:])

    run(body)


INVALID_SCHEMA = {"type": "object", "properties": {"foo": "bar"}}


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        # test_completion.py::test_invalid_json_schema / test_invalid_regex /
        # test_invalid_grammar, in vLLM's current `structured_outputs` and the guided_* form.
        ({"structured_outputs": {"json": INVALID_SCHEMA}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "[.*"}}, "structured_outputs"),
        (
            {"structured_outputs": {"grammar": "root ::= select_statementinvalidsyntax"}},
            "structured_outputs",
        ),
        ({"guided_json": INVALID_SCHEMA}, "guided_json"),
        ({"guided_regex": "[.*"}, "guided_regex"),
        ({"guided_grammar": "root ::= nowhere"}, "guided_grammar"),
        # test_chat.py::test_structured_outputs_type_error: a regex that is not a string.
        ({"structured_outputs": {"regex": {"1": "Python", "2": "C++"}}}, "structured_outputs"),
        # test_chat.py::test_long_seed: seeds outside a signed 64-bit integer.
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**63}, "seed"),
        # test_chat_logit_bias_validation.py: a token id past the vocabulary, keys that are
        # not integers (every one named), a value that is not a number.
        ({"logit_bias": {"1000001": 1.0}}, "logit_bias"),
        ({"logit_bias": {"bad1": 50.0, "bad2": 20.0}}, "logit_bias"),
        ({"logit_bias": {"1": "not_a_number"}}, "logit_bias"),
        # README's deliberate difference: no beam search (test_batch_completions sends it).
        ({"use_beam_search": True}, "use_beam_search"),
        # test_serving_chat.py::test_serving_chat_did_set_correct_cache_salt: vLLM salts the
        # prefix cache per request; pdserve does not (README), and says so.
        ({"cache_salt": "test_salt"}, "cache_salt"),
    ],
)
def test_invalid_requests_are_400s_naming_the_field(
    tiny_model_path: Path, patch: dict[str, Any], param: str
) -> None:
    """The requests vLLM's tests expect a 400 for, on /v1/completions and chat alike."""

    async def body() -> None:
        async with router(tiny_model_path, workers("colocated"), mode="colocated") as client:
            for path, req in (("/v1/completions", completion()), ("/v1/chat/completions", chat())):
                resp = await client.post(path, json={**req, **patch})
                error = (await resp.json())["error"]
                assert resp.status == 400 and error["param"] == param, (path, error)
                if param in ("use_beam_search", "cache_salt"):
                    assert error["code"] == "unsupported_parameter", error
                if param == "logit_bias" and "bad1" in patch["logit_bias"]:
                    assert "bad1" in error["message"] and "bad2" in error["message"]

    run(body)


@MODES
def test_structured_outputs_and_logit_bias_reach_the_worker(
    tiny_model_path: Path, mode: str
) -> None:
    """test_chat.py::test_structured_outputs_choice_chat / _json_chat / _regex_chat and
    test_response_format_json_object / _json_schema / _text, test_chat_logit_bias_valid:
    `structured_outputs` asks for the same grammar as the guided_* field of the same kind and
    as `response_format`, `response_format: text` for none, and a bias on the last token of
    the vocabulary is taken; the worker is sent it, colocated or as the prefill.
    (Outputs valid under the grammar, on real workers and every path:
    tests/openai_cases.py's guided-choice and json-schema cases.)"""
    served = workers(mode)
    schema = {"type": "object", "properties": {"result": {"type": "integer"}}}
    vocab = Tokenizer(tiny_model_path).vocab_size

    async def grammar(client: Any, patch: dict[str, Any]) -> Any:
        for w in served:
            w.samplings.clear()
        resp = await client.post("/v1/chat/completions", json=chat(**patch))
        assert resp.status == 200, await resp.text()
        sent = {json.dumps(w.samplings[-1].grammar.model_dump()) if w.samplings[-1].grammar
                else None for w in served if w.samplings}  # fmt: skip
        assert len(sent) == 1, sent
        return sent.pop()

    async def body() -> None:
        async with router(tiny_model_path, served, mode=mode) as client:
            pairs = [
                ({"structured_outputs": {"choice": ["a", "b"]}}, {"guided_choice": ["a", "b"]}),
                ({"structured_outputs": {"json": schema}}, {"guided_json": schema}),
                ({"structured_outputs": {"regex": "[0-9]+"}}, {"guided_regex": "[0-9]+"}),
                ({"structured_outputs": {"json": schema}},
                 {"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "r", "schema": schema}}}),
                ({"structured_outputs": {"json_object": True}},
                 {"response_format": {"type": "json_object"}}),
            ]  # fmt: skip
            for new, old in pairs:
                got = await grammar(client, new)
                assert got is not None and got == await grammar(client, old)
            assert await grammar(client, {"response_format": {"type": "text"}}) is None
            await grammar(client, {"logit_bias": {str(vocab - 1): 1.0}})
            assert all(
                w.samplings[-1].logit_bias == [(vocab - 1, 1.0)] for w in served if w.samplings
            )

    run(body)


def test_all_vocabulary_logprobs_are_refused(tiny_model_path: Path) -> None:
    """vLLM's chat_completion/protocol.py admits `top_logprobs: -1` (the whole vocabulary),
    which vLLM's default `--max-logprobs 20` then refuses, as it refuses 21
    (test_chat.py::test_too_many_chat_logprobs); pdserve's limit is fixed at 20 (README): -1
    is a 400 naming the field, in chat (`top_logprobs`), completions (`logprobs`) and chat
    `prompt_logprobs` alike, and the server still answers afterwards."""

    async def body() -> None:
        async with router(tiny_model_path, workers("colocated"), mode="colocated") as client:
            for path, req, param in (
                ("/v1/chat/completions", chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
                ("/v1/chat/completions", chat(logprobs=True, top_logprobs=30), "top_logprobs"),
                ("/v1/chat/completions", chat(prompt_logprobs=-1), "prompt_logprobs"),
                ("/v1/completions", completion(logprobs=-1), "logprobs"),
            ):
                resp = await client.post(path, json=req)
                error = (await resp.json())["error"]
                assert resp.status == 400 and error["param"] == param, (path, error)
            resp = await client.post("/v1/chat/completions", json=chat())
            assert resp.status == 200

    run(body)


@MODES
def test_serving_chat_sets_max_tokens(tiny_model_path: Path, mode: str) -> None:
    """vLLM test_serving_chat.py::test_serving_chat_should_set_correct_max_tokens (max_model_len
    100): without max_tokens the worker is asked for the rest of the context (100 minus the
    prompt), with max_tokens 10 for 10, with max_completion_tokens 5 for 5; a limit past the
    context is a 400 naming the field the client sent (vLLM's serving layer refuses it:
    "maximum context length")."""
    served = workers(mode)
    messages = [{"role": "user", "content": "what is 1+1?"}]
    num_prompt = len(Tokenizer(tiny_model_path).encode_chat(messages, True))

    async def body() -> None:
        async with router(tiny_model_path, served, mode=mode, max_model_len=100) as client:
            for patch, expected in (
                ({}, 100 - num_prompt),
                ({"max_tokens": 10}, 10),
                ({"max_tokens": 10, "max_completion_tokens": 5}, 5),
            ):
                for w in served:
                    w.samplings.clear()
                req = {"model": "tiny-v2", "messages": messages, **patch}
                resp = await client.post("/v1/chat/completions", json=req)
                assert resp.status == 200, await resp.text()
                assert {w.samplings[-1].max_tokens for w in served if w.samplings} == {expected}
            for field in ("max_tokens", "max_completion_tokens"):
                req = {"model": "tiny-v2", "messages": messages, field: 100}
                resp = await client.post("/v1/chat/completions", json=req)
                error = (await resp.json())["error"]
                assert resp.status == 400 and error["param"] == field, error
                assert error["code"] == "context_length_exceeded"

    run(body)


@MODES
def test_prompt_logprobs_completion(tiny_model_path: Path, mode: str) -> None:
    """test_completion.py::test_prompt_logprobs_completion (two prompts; prompt_logprobs -1,
    0, 1, None): each choice carries its own prompt's `prompt_logprobs` (one entry per
    prompt token, None first), none without the field, -1 a 400; (vLLM's CompletionRequest
    validator) with `stream` a 400."""
    tokenizer = Tokenizer(tiny_model_path)
    prompts = ["A robot may not injure another robot", "My name is"]

    async def body() -> None:
        async with router(tiny_model_path, workers(mode), mode=mode) as client:
            for asked in (0, 1):
                req = completion(prompt=prompts, prompt_logprobs=asked)
                resp = await client.post("/v1/completions", json=req)
                choices = (await resp.json())["choices"]
                assert resp.status == 200 and len(choices) == 2, choices
                for prompt, choice in zip(prompts, choices, strict=True):
                    ids = tokenizer.encode(prompt)
                    lps = choice["prompt_logprobs"]
                    assert len(lps) == len(ids) and lps[0] is None
                    assert all(str(t) in p for t, p in zip(ids[1:], lps[1:], strict=True))
            data = await (
                await client.post("/v1/completions", json=completion(prompt=prompts))
            ).json()
            assert all("prompt_logprobs" not in c for c in data["choices"])
            for bad in (completion(prompt_logprobs=-1), completion(prompt_logprobs=0, stream=True)):
                resp = await client.post("/v1/completions", json=bad)
                error = (await resp.json())["error"]
                assert resp.status == 400 and error["param"] == "prompt_logprobs", error

    run(body)


@pytest.mark.parametrize("source", ["auto", "vllm"])
def test_serving_chat_loads_generation_config(
    tiny_model_path: Path, tmp_path: Path, source: str
) -> None:
    """vLLM test_serving_chat.py::test_serving_chat_could_load_correct_generation_config and
    the server-side half of test_serving_chat_should_set_correct_max_tokens: with the model's
    generation_config.json setting temperature 0.5, repetition_penalty 1.05 and
    max_new_tokens 10, a request that sends neither is sampled with them, one that sends
    temperature (0.1, or 0.0) keeps its own and the model's repetition_penalty, and
    max_tokens is capped at 10 (15 -> 10, 5 stays 5), in chat and completions.
    `--generation-config vllm` ignores the file (the API's defaults)."""
    model = tmp_path / "tiny-v2"
    shutil.copytree(tiny_model_path, model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=0.5, repetition_penalty=1.05, max_new_tokens=10)
    (model / "generation_config.json").write_text(json.dumps(config))
    served = workers("colocated")
    auto = source == "auto"

    async def sampled(client: Any, path: str, req: dict[str, Any]) -> Any:
        resp = await client.post(path, json=req)
        assert resp.status == 200, await resp.text()
        return served[0].samplings[-1]

    async def body() -> None:
        async with router(model, served, mode="colocated", generation_config=source) as client:
            plain = {"model": "tiny-v2", "messages": [{"role": "user", "content": "1+1?"}]}
            for path, req in (("/v1/chat/completions", plain),
                              ("/v1/completions", {"model": "tiny-v2", "prompt": "1+1?"})):  # fmt: skip
                got = await sampled(client, path, req)
                assert got.temperature == (0.5 if auto else 1.0)
                assert got.repetition_penalty == (1.05 if auto else 1.0)
                for sent in (0.1, 0.0):
                    got = await sampled(client, path, {**req, "temperature": sent})
                    assert got.temperature == sent
                    assert got.repetition_penalty == (1.05 if auto else 1.0)
                for asked, expected in ((15, 10 if auto else 15), (5, 5)):
                    got = await sampled(client, path, {**req, "max_tokens": asked})
                    assert got.max_tokens == expected
            got = await sampled(client, "/v1/chat/completions", plain)
            assert got.max_tokens == (10 if auto else 2048 - len(
                Tokenizer(model).encode_chat(plain["messages"], True)))  # fmt: skip

    run(body)


def test_prompt_body_and_stop_token_validation(tiny_model_path: Path) -> None:
    """test_chat_stop_token_ids_validation.py (the vocabulary's last id is taken; one past it
    is a 400 whose message names the id and the vocabulary size; a negative id a 400),
    test_empty_prompt_list.py and test_prompt_validation.py (an empty prompt list, a null
    prompt, a token id out of the vocabulary: 400s), test_non_object_body_validation.py (a
    body that is bad JSON, a string, a list, a number or null: a 400, never a 500)."""
    vocab = Tokenizer(tiny_model_path).vocab_size

    async def body() -> None:
        async with router(tiny_model_path, workers("colocated"), mode="colocated") as client:
            resp = await client.post("/v1/chat/completions", json=chat(stop_token_ids=[vocab - 1]))
            assert resp.status == 200, await resp.text()
            for ids in ([vocab + 1], [-1]):
                resp = await client.post("/v1/chat/completions", json=chat(stop_token_ids=ids))
                error = (await resp.json())["error"]
                assert resp.status == 400 and error["param"] == "stop_token_ids", error
                if ids[0] > 0:
                    assert str(vocab + 1) in error["message"] and str(vocab) in error["message"]
            for prompt in ([], None, [999999]):
                resp = await client.post("/v1/completions", json=completion(prompt=prompt))
                error = (await resp.json())["error"]
                assert resp.status == 400 and error["param"] == "prompt", error
            for raw in (b"this is not valid json{{{", b'"text"', b'["not", "an", "object"]',
                        b"42", b"null"):  # fmt: skip
                for path in ("/v1/completions", "/v1/chat/completions"):
                    resp = await client.post(
                        path, data=raw, headers={"Content-Type": "application/json"}
                    )
                    error = (await resp.json())["error"]
                    assert resp.status == 400 and error["message"], (path, raw, error)

    run(body)


@MODES
def test_return_token_ids(tiny_model_path: Path, mode: str) -> None:
    """test_return_token_ids.py (test_basic_completion_with_emoji, test_chat_completion_with_
    emoji_and_token_ids, the streamed half of test_comparison_with_prompt_logprobs_and_
    logprobs): with `return_token_ids` a completion choice carries its `prompt_token_ids`
    (streamed: on its first chunk) and its `token_ids`, whose decode starts the text; a chat
    answer carries the template's `prompt_token_ids` (streamed: on the first chunk only) and
    each choice's `token_ids`, streamed as the whole answer's; without the field none of
    them."""
    tokenizer = Tokenizer(tiny_model_path)
    prompt = "Complete this sentence with emojis: I love coding 🚀"
    messages = [{"role": "system", "content": "You like emojis."},
                {"role": "user", "content": "Repeat after me: I love cats 🐱"}]  # fmt: skip
    chat_ids = tokenizer.encode_chat(messages, True)

    async def body() -> None:
        async with router(tiny_model_path, workers(mode), mode=mode) as client:
            req = completion(5, prompt=prompt, logprobs=1, return_token_ids=True)
            choice = (await (await client.post("/v1/completions", json=req)).json())["choices"][0]
            assert choice["prompt_token_ids"] == tokenizer.encode(prompt)
            assert choice["token_ids"] == TOKENS[:5]
            assert tokenizer.decode(choice["token_ids"]).startswith(choice["text"])
            resp = await client.post("/v1/completions", json={**req, "stream": True})
            chunks = events(await resp.read())
            assert chunks[0]["choices"][0]["prompt_token_ids"] == tokenizer.encode(prompt)
            assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
            streamed = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
            assert streamed == TOKENS[:5]
            req = chat(messages=messages, max_tokens=5, logprobs=True, return_token_ids=True)
            data = await (await client.post("/v1/chat/completions", json=req)).json()
            assert data["prompt_token_ids"] == chat_ids
            assert data["choices"][0]["token_ids"] == TOKENS[:5]
            assert "I love cats 🐱" in tokenizer.decode(data["prompt_token_ids"])
            resp = await client.post("/v1/chat/completions", json={**req, "stream": True})
            chunks = events(await resp.read())
            assert chunks[0]["prompt_token_ids"] == chat_ids
            assert all("prompt_token_ids" not in c for c in chunks[1:])
            streamed = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
            assert streamed == TOKENS[:5]
            for path, plain in (("/v1/completions", completion(prompt=prompt)),
                                ("/v1/chat/completions", chat())):  # fmt: skip
                data = await (await client.post(path, json=plain)).json()
                assert "prompt_token_ids" not in data
                assert all("prompt_token_ids" not in c and "token_ids" not in c
                           for c in data["choices"])  # fmt: skip

    run(body)


TOOL = {"type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}  # fmt: skip


@MODES
def test_tool_choice_null_fingerprint_and_text_offsets(tiny_model_path: Path, mode: str) -> None:
    """test_tool_choice_null.py (`tool_choice: null` means the same as no tool_choice, with or
    without tools, and does not clash with structured_outputs; "bogus", and "auto" without
    tools, are 400s), test_system_fingerprint_none.py (no `system_fingerprint` key rather than
    a null one) and test_completion_text_offset.py (the streamed `text_offset`s, with a stop
    string holding text back, equal the whole answer's)."""
    served = workers(mode)

    async def body() -> None:
        async with router(tiny_model_path, served, mode=mode) as client:
            for patch in ({"tools": [TOOL]}, {}):
                sent = []
                for extra in ({}, {"tool_choice": None}):
                    for w in served:
                        w.samplings.clear()
                    resp = await client.post(
                        "/v1/chat/completions", json=chat(seed=1, **patch, **extra)
                    )
                    assert resp.status == 200, await resp.text()
                    sent.append([s.model_dump() for w in served for s in w.samplings])
                assert sent[0] == sent[1]
            resp = await client.post(
                "/v1/chat/completions",
                json=chat(tool_choice=None, structured_outputs={"json": {"type": "object"}}),
            )
            assert resp.status == 200, await resp.text()
            for bad in (chat(tools=[TOOL], tool_choice="bogus"), chat(tool_choice="auto")):
                resp = await client.post("/v1/chat/completions", json=bad)
                error = (await resp.json())["error"]
                assert resp.status == 400 and error["param"] == "tool_choice", error
            for path, req in (("/v1/chat/completions", chat()), ("/v1/completions", completion())):
                data = await (await client.post(path, json=req)).json()
                assert "system_fingerprint" not in data
            req = completion(5, prompt="Hi", logprobs=0, stop=["\n\n"])
            whole = (await (await client.post("/v1/completions", json=req)).json())["choices"][0]
            resp = await client.post("/v1/completions", json={**req, "stream": True})
            offsets = [o for c in events(await resp.read())
                       for o in (c["choices"][0]["logprobs"] or {}).get("text_offset", [])]  # fmt: skip
            assert offsets == whole["logprobs"]["text_offset"] and len(offsets) == 5

    run(body)
