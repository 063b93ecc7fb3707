"""Where vLLM's /v1/completions (and the sampling it shares with chat) and pdserve's must
agree (issue 33), on fake workers, colocated and disaggregated: each test names the vLLM test
it re-expresses (tests/entrypoints/openai/completion/test_completion.py, chat_completion/
test_chat.py, ...); our own tests, not copies. The fake worker's script is the same for every
request, so what vLLM checks through a real model's text (distinct samples, valid JSON) is
checked through the request the worker was sent, and across paths in
tests/integration/test_openai_client.py. Validation: test_vllm_validation_conformance.py."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from router_harness import completion, router, run
from vllm_cases import MODES, TOKENS, chat, events, workers

from pdserve.model.tokenizer import Tokenizer


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
        sent = {json.dumps(dataclasses.asdict(w.samplings[-1].grammar), default=str) if w.samplings[-1].grammar
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
                w.samplings[-1].logit_bias == ((vocab - 1, 1.0),) for w in served if w.samplings
            )

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
