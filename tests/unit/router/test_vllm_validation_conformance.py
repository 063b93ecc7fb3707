"""The requests vLLM's OpenAI server refuses, and the ones it must not (issue 33), on fake
workers: each test names the vLLM test it re-expresses (validation tests of
tests/entrypoints/openai/); our own tests, not copies. A refusal is a 400 whose `param` names
the field, never a 500."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from router_harness import completion, router, run
from vllm_cases import MODES, chat, events, workers

from pdserve.model.tokenizer import Tokenizer

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
        # return_tokens_as_token_ids takes a boolean (served since issue 33: test_vllm_
        # completion_conformance.py).
        ({"return_tokens_as_token_ids": "maybe"}, "return_tokens_as_token_ids"),
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
                    sent.append([dataclasses.asdict(s) for w in served for s in w.samplings])
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
