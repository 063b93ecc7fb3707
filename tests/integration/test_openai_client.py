"""The official `openai` client against real workers: every feature gives the same text and
the same logprobs (bitwise, float32 through JSON) colocated, disaggregated, streamed or not,
and after a re-prefill; the client parses every response. (Migration after a real worker kill:
tests/chaos/test_feature_migration.py.)

One cluster for the module: two prefill workers, two `both` workers, and two routers over
them, one with a router fault that loses the first prefill of every other request (so the
request re-prefills on the other prefill worker). Local suffix prefill is off, so every
disaggregated request takes the KV-transfer path.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai
import pytest
from openai_cases import CASES, MODEL, TOOLS, check_valid, client, run_case
from worker_proc import launch_worker, router_process, wait_ready, worker_processes

from pdserve.model.tokenizer import Tokenizer

# Bitwise-equal logprobs on every path need the batch-invariant forward (off by default).
WORKER_ARGS = ("--kv-cache-bytes", str(32 << 20), "--batch-invariant")
LOSE_HALF_THE_PREFILLS = [
    "--fault",
    "router.after_prefill:close:probability=0.5",
    "--fault-seed",
    "3",
]


def post(url: str, body: object) -> dict[str, object]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        data: dict[str, object] = json.loads(resp.read())
        return data


def post_error(url: str, body: object) -> tuple[int, dict[str, object]]:
    """A request the router must refuse: its status and the error object."""
    with pytest.raises(urllib.error.HTTPError) as info:
        post(url, body)
    error: dict[str, object] = json.loads(info.value.read())["error"]
    return info.value.code, error


def get(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=30) as resp:
        data: dict[str, object] = json.loads(resp.read())
        return data


@pytest.fixture(scope="module")
def cluster(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """(plain router URL, router URL whose prefills are lost once in two)."""
    workdir = tmp_path_factory.mktemp("openai-cluster")
    with worker_processes() as handles, ExitStack() as stack:
        for role in ("prefill", "prefill", "both", "both"):
            handles.append(
                launch_worker(role, workdir, model=tiny_model_path, extra_args=WORKER_ARGS)
            )
        for handle in handles:
            wait_ready(handle)
        urls = [h.url for h in handles]
        common = ["--local-prefill-threshold", "0"]
        (workdir / "plain").mkdir()
        (workdir / "faulty").mkdir()
        plain = stack.enter_context(
            router_process(workdir / "plain", tiny_model_path, urls, extra_args=common)
        )
        faulty = stack.enter_context(
            router_process(
                workdir / "faulty",
                tiny_model_path,
                urls,
                extra_args=[*common, *LOSE_HALF_THE_PREFILLS],
            )
        )
        yield plain, faulty


def layouts(cluster: tuple[str, str]) -> Iterator[str]:
    """The plain router disaggregated, then colocated (switched back after), then the router
    whose prefills are lost once in two (re-prefills): each URL while it serves that way."""
    plain, faulty = cluster
    yield plain
    post(f"{plain}/admin/mode", {"mode": "colocated"})
    try:
        yield plain
    finally:
        post(f"{plain}/admin/mode", {"mode": "disagg"})
    yield faulty


@pytest.mark.parametrize("name", list(CASES))
def test_every_feature_is_identical_across_paths(cluster: tuple[str, str], name: str) -> None:
    plain, faulty = cluster
    reference = run_case(plain, name, stream=False)
    check_valid(name, reference)
    assert run_case(plain, name, stream=True) == reference
    post(f"{plain}/admin/mode", {"mode": "colocated"})
    try:
        assert run_case(plain, name, stream=False) == reference
        assert run_case(plain, name, stream=True) == reference
    finally:
        post(f"{plain}/admin/mode", {"mode": "disagg"})
    # Through the router that loses prefills: some requests re-prefill; every answer is the same.
    for stream in (False, True, False):
        assert run_case(faulty, name, stream=stream) == reference


def test_responses_api_is_identical_across_paths(cluster: tuple[str, str]) -> None:
    """/v1/responses through the official client: a forced, sampled function call and text,
    whole and streamed, colocated and disaggregated: the same output items."""
    plain, _ = cluster
    api = client(plain)
    tools = [{"type": "function", **TOOLS[0]["function"]}]

    def outputs(**kw: object) -> list[tuple[object, ...]]:
        if kw.pop("stream", False):
            # The last event carries the response: response.completed, or .incomplete when
            # max_output_tokens cut it (which the client's stream helper does not finish on).
            *_, last = api.responses.create(model="tiny-v2", stream=True, **kw)  # type: ignore[call-overload]
            resp = last.response
        else:
            resp = api.responses.create(model="tiny-v2", **kw)  # type: ignore[arg-type]
        return [(o.type, getattr(o, "name", None), getattr(o, "arguments", None),
                 o.content[0].text if o.type == "message" else None) for o in resp.output]  # type: ignore[union-attr]  # fmt: skip

    cases = [
        {"input": "Weather in Lima?", "tools": tools, "tool_choice": "required",
         "parallel_tool_calls": False, "temperature": 0.8, "extra_body": {"seed": 4}},
        {"input": "Once upon a time", "max_output_tokens": 12, "temperature": 0},
    ]  # fmt: skip
    for case in cases:
        reference = outputs(**case)
        assert outputs(stream=True, **case) == reference
        post(f"{plain}/admin/mode", {"mode": "colocated"})
        try:
            assert outputs(**case) == reference
            assert outputs(stream=True, **case) == reference
        finally:
            post(f"{plain}/admin/mode", {"mode": "disagg"})
    call = outputs(**cases[0])[0]
    assert call[:2] == ("function_call", "get_weather") and json.loads(str(call[2]))["city"]


def test_reprefills_really_happened(cluster: tuple[str, str]) -> None:
    _, faulty = cluster
    metrics = urllib.request.urlopen(f"{faulty}/metrics", timeout=10).read().decode()
    retried = [ln for ln in metrics.splitlines()
               if ln.startswith("pdserve_router_retries_total") and "prefill" in ln]  # fmt: skip
    assert retried and any(float(ln.rsplit(" ", 1)[1]) > 0 for ln in retried), metrics


def test_client_errors_are_openai_errors(cluster: tuple[str, str]) -> None:
    plain, _ = cluster
    api = client(plain)
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(
            model="tiny-v2",
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}},
        )  # fmt: skip
    assert info.value.body["param"] == "response_format"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model="tiny-v2", prompt="x", suffix="y")
    assert info.value.body["param"] == "suffix"  # type: ignore[index]
    models = api.models.list()
    assert [m.id for m in models.data] == ["tiny-v2"]
    assert get(f"{plain}/version")["version"]


def test_tokenize_as_vllm_answers(cluster: tuple[str, str], tiny_model_path: Path) -> None:
    """vLLM tests/entrypoints/openai/test_tokenization.py, re-expressed on every layout
    (colocated, disaggregated, re-prefilled):
    test_tokenize_completions (tokens, count, max_model_len, `token_strs` null for either
    add_special_tokens), test_tokenize_chat and test_tokenize_chat_with_tools (the template's
    prompt with add_generation_prompt / continue_final_message / add_special_tokens, tools
    rendered), test_tokenize_with_return_token_strs (the vocabulary's own pieces, as
    convert_ids_to_tokens), test_detokenize (`{"prompt": text}` and nothing else)."""
    tok = Tokenizer(tiny_model_path)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"location": {"type": "string"}}}}}]  # fmt: skip
    for url in layouts(cluster):
        max_len = post(f"{url}/tokenize", {"prompt": "x"})["max_model_len"]
        assert isinstance(max_len, int) and max_len > 0
        for add_special in (False, True):
            prompt = "vllm1 This is a test prompt."
            ids = tok.encode(prompt, add_special_tokens=add_special)
            got = post(f"{url}/tokenize", {"model": MODEL, "prompt": prompt,
                                          "add_special_tokens": add_special})  # fmt: skip
            assert got == {"count": len(ids), "max_model_len": max_len, "tokens": ids,
                           "token_strs": None}  # fmt: skip
        for with_tools in (False, True):
            for add_gen in (False, True):
                for add_special in (False, True):
                    for cont in (False, True):
                        if add_gen and cont:
                            continue
                        conv = [
                            {"role": "user", "content": "Hi there!"},
                            {"role": "assistant", "content": "Nice to meet you!"},
                            {"role": "user", "content": "Can I ask a question? vllm1"},
                        ]
                        conv += [{"role": "assistant", "content": "Sure,"}] * cont
                        text = tok.render_chat(conv, add_gen, tools if with_tools else None,
                                               continue_final_message=cont)  # fmt: skip
                        ids = tok.encode(text, add_special_tokens=add_special)
                        req = {"model": MODEL, "messages": conv, "add_generation_prompt": add_gen,
                               "continue_final_message": cont, "add_special_tokens": add_special,
                               **({"tools": tools} if with_tools else {})}  # fmt: skip
                        got = post(f"{url}/tokenize", req)
                        assert got == {"count": len(ids), "max_model_len": max_len,
                                       "tokens": ids, "token_strs": None}, req  # fmt: skip
                        if cont:
                            assert text.endswith("Sure,")
        prompt = "This is a token_strs test prompt! vllm1"
        ids = tok.encode(prompt)
        got = post(f"{url}/tokenize", {"model": MODEL, "prompt": prompt, "return_token_strs": True})
        assert got["tokens"] == ids and got["token_strs"] == tok.token_strs(ids)
        prompt = "This is a test prompt. vllm1"
        ids = tok.encode(prompt, add_special_tokens=False)
        assert post(f"{url}/detokenize", {"model": MODEL, "tokens": ids}) == {"prompt": prompt}
        # As /v1/chat/completions: continuing the final message and opening a new one is a 400.
        both = {"messages": [{"role": "assistant", "content": "Sure,"}],
                "continue_final_message": True, "add_generation_prompt": True}  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as info:
            post(f"{url}/tokenize", both)
        assert info.value.code == 400
        assert json.loads(info.value.read())["error"]["param"] == "continue_final_message"


def test_basic_endpoints_as_vllm_answers(cluster: tuple[str, str]) -> None:
    """vLLM tests/entrypoints/openai/test_basic.py, re-expressed on every layout
    (colocated, disaggregated, re-prefilled):
    test_show_version (`{"version": ...}` and nothing else), test_check_health (200), and
    test_request_wrong_content_type (a form-encoded body is refused: 415, an OpenAI error)."""
    for url in layouts(cluster):
        version = get(f"{url}/version")
        assert list(version) == ["version"] and isinstance(version["version"], str)
        with urllib.request.urlopen(f"{url}/health", timeout=30) as resp:
            assert resp.status == 200
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        req = urllib.request.Request(
            f"{url}/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/x-www-form-urlencoded"},
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        assert info.value.code == 415
        error = json.loads(info.value.read())["error"]
        assert error["code"] == "unsupported_media_type" and error["message"]
        # Deliberate difference (README, "Honest refusals"): no Content-Type is read as JSON.
        host, port = url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.putrequest("POST", "/tokenize", skip_accept_encoding=True)
        raw = json.dumps({"prompt": "hi"}).encode()
        conn.putheader("Content-Length", str(len(raw)))
        conn.endheaders(raw)
        answer = conn.getresponse()
        assert answer.status == 200 and json.loads(answer.read())["count"] > 0
        conn.close()
        # Deliberate difference (README, "Honest refusals"): OpenAI's error shape, `type`
        # "invalid_request_error" and a string `code` (vLLM: "BadRequestError" and 400).
        req = urllib.request.Request(
            f"{url}/v1/completions",
            json.dumps({"model": MODEL, "prompt": "x", "logprobs": 21}).encode(),
            {"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        error = json.loads(info.value.read())["error"]
        assert info.value.code == 400 and set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["param"] == "logprobs"
        with pytest.raises(openai.APIStatusError):
            client(url).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                extra_headers={"Content-Type": "application/x-www-form-urlencoded"},
            )  # fmt: skip


def test_chat_echo_with_continue_final_message(cluster: tuple[str, str]) -> None:
    """vLLM tests/entrypoints/openai/test_chat_echo.py::
    test_chat_session_with_echo_and_continue_final_message, colocated, disaggregated and re-prefilled, streamed and
    not: with `echo` the content starts with the continued assistant message's text, without
    it the content is only the continuation, the same on every path. (Its `finish_reason ==
    "stop"` belongs to its instruct model: the tiny random model runs to max_tokens.)"""
    saying = "Here is a common saying about apple. An apple a day, keeps"
    messages = [{"role": "user", "content": "tell me a common saying"},
                {"role": "assistant", "content": saying}]  # fmt: skip
    answers = []
    for url in layouts(cluster):
        api = client(url)
        for stream in (False, True):
            got = {}
            for echo in (True, False):
                extra = {"echo": echo, "continue_final_message": True,
                         "add_generation_prompt": False}  # fmt: skip
                kw = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0,
                      "extra_body": extra}  # fmt: skip
                if stream:
                    chunks = list(api.chat.completions.create(stream=True, **kw))  # type: ignore[call-overload]
                    assert chunks[0].choices[0].delta.role == "assistant"
                    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                else:
                    out = api.chat.completions.create(**kw)  # type: ignore[call-overload]
                    assert out.id and len(out.choices) == 1
                    assert out.choices[0].message.role == "assistant"
                    text = out.choices[0].message.content
                got[echo] = text
            assert got[True].startswith(saying) and saying not in got[False]
            assert got[True] == saying + got[False]
            answers.append(got[False])
    assert len(set(answers)) == 1, answers


def test_logprobs_streaming_and_stream_options_as_vllm(cluster: tuple[str, str]) -> None:
    """vLLM tests/entrypoints/openai/test_chat.py and test_completion.py, the model-independent
    assertions, on every layout (colocated, disaggregated, re-prefilled):
    test_no_logprobs_chat (no logprobs object),
    test_zero_logprobs_chat / test_some_logprobs_chat (`top_logprobs` alternatives per token),
    test_too_many_chat_logprobs / test_too_many_completion_logprobs (21 is a 400, streamed or
    not), test_chat_streaming / test_completion_streaming (greedy streamed text and finish
    reason equal the whole answer's, the role first), test_chat_completion_stream_options /
    test_completion_stream_options (no usage without include_usage; with it, only a last
    chunk with no choices carries it and its totals add up; stream_options without stream is
    a 400)."""
    msgs = [{"role": "user", "content": "what is 1+1?"}]
    for url in layouts(cluster):
        api = client(url)
        chat = {"model": MODEL, "messages": msgs, "max_tokens": 5, "temperature": 0}
        out = api.chat.completions.create(**chat, logprobs=False)  # type: ignore[call-overload]
        assert out.choices[0].logprobs is None
        for top in (0, 5):
            out = api.chat.completions.create(**chat, logprobs=True, top_logprobs=top)  # type: ignore[call-overload]
            content = out.choices[0].logprobs.content
            assert content and all(len(t.top_logprobs) == top for t in content)
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError):
                api.chat.completions.create(**chat, logprobs=True, top_logprobs=21, stream=stream)  # type: ignore[call-overload]
            with pytest.raises(openai.BadRequestError):
                api.completions.create(model=MODEL, prompt="x", logprobs=21, stream=stream)
        whole = api.chat.completions.create(**chat)  # type: ignore[call-overload]
        chunks = list(api.chat.completions.create(**chat, stream=True))  # type: ignore[call-overload]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks)
            == whole.choices[0].message.content
        )
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
        comp = {"model": MODEL, "prompt": "What is an LLM?", "max_tokens": 5, "temperature": 0}
        whole_c = api.completions.create(**comp)  # type: ignore[call-overload]
        chunks_c = list(api.completions.create(**comp, stream=True))  # type: ignore[call-overload]
        assert "".join(c.choices[0].text for c in chunks_c) == whole_c.choices[0].text
        assert chunks_c[-1].choices[0].finish_reason == whole_c.choices[0].finish_reason
        for kind, create, req in (("chat", api.chat.completions.create, chat),
                                  ("completion", api.completions.create, comp)):  # fmt: skip
            plain = list(create(**req, stream=True, stream_options={"include_usage": False}))  # type: ignore[operator]
            assert all(c.usage is None for c in plain), kind
            usage = list(create(**req, stream=True, stream_options={"include_usage": True}))  # type: ignore[operator]
            assert all(c.usage is None for c in usage[:-1]), kind
            last = usage[-1]
            assert last.choices == [] and last.usage is not None, kind
            u = last.usage
            assert u.prompt_tokens > 0 and u.completion_tokens > 0
            assert u.prompt_tokens + u.completion_tokens == u.total_tokens
            with pytest.raises(openai.BadRequestError):
                create(**req, stream=False, stream_options={"include_usage": True})  # type: ignore[operator]


def test_prompt_logprobs_in_chat_as_vllm(cluster: tuple[str, str], tiny_model_path: Path) -> None:
    """vLLM tests/entrypoints/openai/chat_completion/test_chat.py::test_prompt_logprobs_chat and
    test_more_than_one_prompt_logprobs_chat, on real workers and every layout (colocated,
    disaggregated, re-prefilled): one entry per prompt token, None first; with N alternatives
    each position has N entries, N + 1 when the prompt's own token is not among them; the
    same values on every path."""
    tok = Tokenizer(tiny_model_path)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Who won the world series in 2020?"}]  # fmt: skip
    num_prompt = len(tok.encode_chat(messages, True))
    answers = []
    for url in layouts(cluster):
        got = {}
        for asked in (1, 2):
            out = client(url).chat.completions.create(
                model=MODEL, messages=messages, max_tokens=2, temperature=0,  # type: ignore[arg-type]
                extra_body={"prompt_logprobs": asked},
            )  # fmt: skip
            lps = out.prompt_logprobs  # type: ignore[attr-defined]
            assert len(lps) == num_prompt and lps[0] is None
            assert all(asked <= len(p) <= asked + 1 for p in lps[1:])
            ranks = [sorted(e["rank"] for e in p.values() if e["rank"]) for p in lps[1:]]
            assert all(r == list(range(1, asked + 1)) for r in ranks)
            got[asked] = lps
        answers.append(json.dumps(got, sort_keys=True))
    assert len(set(answers)) == 1


def test_prompt_logprobs_in_completions_as_vllm(cluster: tuple[str, str]) -> None:
    """vLLM test_completion.py::test_prompt_logprobs_completion and test_echo_logprob_completion
    on real workers and every layout: each of two prompts' choices has its prompt's
    `prompt_logprobs` with N or N + 1 entries per position; with `echo` and `logprobs: 1` as
    well, the echoed prompt keeps 1 or 2 alternatives per position (the worker computed 2);
    the same on every path."""
    prompts = ["A robot may not injure another robot", "My name is"]
    answers = []
    for url in layouts(cluster):
        out = client(url).completions.create(
            model=MODEL, prompt=prompts, max_tokens=2, temperature=0, echo=True, logprobs=1,
            extra_body={"prompt_logprobs": 2},
        )  # fmt: skip
        got = []
        for choice in out.choices:
            lps = choice.prompt_logprobs  # type: ignore[attr-defined]
            assert lps[0] is None and all(2 <= len(p) <= 3 for p in lps[1:])
            tops = choice.logprobs.top_logprobs  # type: ignore[union-attr]
            assert tops[0] is None and all(1 <= len(t) <= 2 for t in tops[1:])
            got.append([lps, choice.logprobs.token_logprobs])  # type: ignore[union-attr]
        answers.append(json.dumps(got, sort_keys=True))
    assert len(set(answers)) == 1


def test_chat_batch_as_vllm_answers(cluster: tuple[str, str]) -> None:
    """vLLM tests/entrypoints/openai/chat_completion/test_batched_chat_completions.py
    (test_batched_chat_completions, ..._with_json_schema) on real workers, colocated,
    disaggregated and re-prefilled: /v1/chat/completions/batch answers one choice per
    conversation, indexed 0 and 1, choice i exactly what /v1/chat/completions answers
    conversation i alone; with a json_schema `response_format` every choice parses and
    matches the schema. The same answers on every path."""
    schema = {"type": "object", "properties": {"answer": {"type": "string",
              "enum": ["yes", "no"]}}, "required": ["answer"]}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    conversations = [[{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
                     [{"role": "user", "content": "Is fire cold? Answer in JSON."}]]  # fmt: skip
    answers = []
    for url in layouts(cluster):
        got = []
        for extra in ({}, {"response_format": fmt}):
            body = {"model": MODEL, "messages": conversations, "max_tokens": 48,
                    "temperature": 0, **extra}  # fmt: skip
            data = post(f"{url}/v1/chat/completions/batch", body)
            choices: list[dict[str, Any]] = data["choices"]  # type: ignore[assignment]
            assert [c["index"] for c in choices] == [0, 1], data
            texts = [c["message"]["content"] for c in choices]
            alone = [
                post(f"{url}/v1/chat/completions", {**body, "messages": c}) for c in conversations
            ]
            assert texts == [a["choices"][0]["message"]["content"] for a in alone]  # type: ignore[index]
            if extra:
                assert all(json.loads(t)["answer"] in ("yes", "no") for t in texts), texts
            got.append(texts)
        answers.append(got)
    assert all(a == answers[0] for a in answers), answers


def test_chat_batch_logprob_token_ids_as_vllm(cluster: tuple[str, str]) -> None:
    """vLLM test_batched_chat_completions.py::test_batched_chat_completions_logprob_token_ids
    on real workers, colocated, disaggregated and re-prefilled (ids within the tiny model's
    2048-token vocabulary, where vLLM's test names 100, 1000, 5000): the top_logprobs of the
    answer's token are exactly the sampled token and the named ones; the same on every path.
    Ids outside the vocabulary, or without logprobs, are a 400 naming the field."""
    body = {"model": MODEL, "messages": [[{"role": "user", "content": "Hello"}]],
            "max_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": 5,
            "logprob_token_ids": [100, 1000, 2000], "return_tokens_as_token_ids": True}  # fmt: skip
    answers = []
    for url in layouts(cluster):
        data = post(f"{url}/v1/chat/completions/batch", body)
        content = data["choices"][0]["logprobs"]["content"]  # type: ignore[index]
        sampled = content[0]["token"]
        tops = {entry["token"] for entry in content[0]["top_logprobs"]}
        assert tops == {"token_id:100", "token_id:1000", "token_id:2000", sampled}, content
        answers.append(content)
    assert all(a == answers[0] for a in answers)
    plain = cluster[0]
    for change, param in (
        ({"logprob_token_ids": [2048]}, "logprob_token_ids"),
        ({"logprobs": False, "top_logprobs": None}, "logprob_token_ids"),
    ):
        one = {**body, **change, "messages": body["messages"][0]}  # type: ignore[index]
        status, error = post_error(f"{plain}/v1/chat/completions", one)
        assert (status, error["param"]) == (400, param), error


def test_return_tokens_as_token_ids_as_vllm(
    cluster: tuple[str, str], tiny_model_path: Path
) -> None:
    """vLLM tests/entrypoints/openai/test_return_tokens_as_ids.py on real workers, colocated,
    disaggregated and re-prefilled, over a prompt whose emoji spans several byte tokens (each
    reads U+FFFD as text): completions with `echo` and `logprobs: 1` name every token
    `token_id:N`, each position's first top_logprobs key is the token itself, and the ids
    decode to the choice's text; a chat answer's ids decode to its content. The same on every
    path."""
    tokenizer = Tokenizer(tiny_model_path)

    def ids(names: list[str]) -> list[int]:
        assert all(n.startswith("token_id:") for n in names), names
        return [int(n.removeprefix("token_id:")) for n in names]

    answers = []
    for url in layouts(cluster):
        req = {"model": MODEL, "prompt": "Say 'Hello, world! 🎉'", "echo": True, "logprobs": 1,
               "max_tokens": 10, "temperature": 0, "return_tokens_as_token_ids": True}  # fmt: skip
        choice: Any = post(f"{url}/v1/completions", req)["choices"][0]  # type: ignore[index]
        tokens, tops = choice["logprobs"]["tokens"], choice["logprobs"]["top_logprobs"]
        assert tokens[1:] == [next(iter(top)) for top in tops[1:]]
        assert choice["text"] == tokenizer.decode(ids(tokens), skip_special_tokens=True)
        messages = [{"role": "system", "content": "You like to respond in only emojis, like 🎉"},
                    {"role": "user", "content": "Please write some emojis: 🐱🐶🎉"}]  # fmt: skip
        req = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0,
               "logprobs": True, "return_tokens_as_token_ids": True}  # fmt: skip
        answer: Any = post(f"{url}/v1/chat/completions", req)["choices"][0]  # type: ignore[index]
        content = [e["token"] for e in answer["logprobs"]["content"]]
        assert (
            tokenizer.decode(ids(content), skip_special_tokens=True) == answer["message"]["content"]
        )
        answers.append((tokens, choice["text"], content))
    assert all(a == answers[0] for a in answers)
