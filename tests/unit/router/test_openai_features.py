"""The OpenAI surface on fake workers: n / best_of / prompt lists (seeds, indices, usage),
logprobs and echo shapes, first-token logprobs across the disaggregated handoff and a
migration, honest refusals, content parts, /tokenize, /detokenize, /version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_worker import FakeWorker, fake_logprob
from router_harness import completion, router, run

from pdserve.router.api import sse
from pdserve.router.api.fanout import choice_seed


@pytest.fixture
def model(tiny_model_path: Path) -> Path:
    return tiny_model_path


TOKENS = [300, 301, 302, 303, 304, 305, 306, 307]


def chat(**kw: object) -> dict[str, object]:
    return {"model": "tiny-v2", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "temperature": 0, **kw}  # fmt: skip


def test_n_and_prompt_lists_fan_out_with_derived_seeds_and_summed_usage(model: Path) -> None:
    both = FakeWorker("both", TOKENS, num_cached_tokens=2)

    async def body() -> None:
        async with router(model, [both], mode="colocated") as client:
            req = completion(max_tokens=3, prompt=["hello", "big world"], n=3, seed=42)
            resp = await client.post("/v1/completions", json=req)
            data = await resp.json()
            assert resp.status == 200, data
            assert [c["index"] for c in data["choices"]] == list(range(6))
            seeds = sorted(s.seed or 0 for s in both.samplings)
            assert seeds == sorted([choice_seed(42, j) for j in range(3)] * 2)
            assert choice_seed(42, 0) == 42 and len(set(seeds)) == 3
            usage = data["usage"]
            hello = len(
                (await (await client.post("/tokenize", json={"prompt": "hello"})).json())["tokens"]
            )
            world = len(
                (await (await client.post("/tokenize", json={"prompt": "big world"})).json())[
                    "tokens"
                ]
            )
            assert usage["prompt_tokens"] == hello + world
            assert usage["completion_tokens"] == 6 * 3
            assert usage["prompt_tokens_details"] == {"cached_tokens": 2 * 2}

    run(body)


def test_streamed_fan_out_names_each_choice(model: Path) -> None:
    both = FakeWorker("both", TOKENS)

    async def body() -> None:
        async with router(model, [both], mode="colocated") as client:
            req = chat(n=2, stream=True, stream_options={"include_usage": True}, seed=1)
            raw = await (await client.post("/v1/chat/completions", json=req)).read()
            events = [json.loads(e) for e in sse.parse_events(raw)[:-1]]
            roles = [e["choices"][0]["index"] for e in events
                     if e["choices"] and e["choices"][0]["delta"].get("role")]  # fmt: skip
            assert sorted(roles) == [0, 1]
            texts = {0: "", 1: ""}
            finishes = {}
            for e in events:
                for c in e["choices"]:
                    texts[c["index"]] += c["delta"].get("content") or ""
                    if c["finish_reason"]:
                        finishes[c["index"]] = c["finish_reason"]
            assert finishes == {0: "length", 1: "length"}
            whole = await (await client.post("/v1/chat/completions", json=chat(n=2, seed=1))).json()
            assert [c["message"]["content"] for c in whole["choices"]] == [texts[0], texts[1]]
            assert events[-1]["usage"]["completion_tokens"] == 8

    run(body)


def test_best_of_returns_the_highest_total_logprob(model: Path) -> None:
    both = FakeWorker("both", TOKENS)

    async def body() -> None:
        async with router(model, [both], mode="colocated") as client:
            req = completion(max_tokens=3, n=1, best_of=4, seed=9)
            data = await (await client.post("/v1/completions", json=req)).json()
            assert len(both.samplings) == 4 and len(data["choices"]) == 1
            best = max(range(4), key=lambda j: fake_logprob(choice_seed(9, j), 0))
            assert data["choices"][0]["index"] == 0
            assert data["choices"][0]["logprobs"] is None  # computed to rank, not asked for
            assert {s.logprobs for s in both.samplings} == {0}
            assert data["usage"]["completion_tokens"] == 3
            asked = await (await client.post("/v1/completions", json={**req, "logprobs": 1})).json()
            lp = asked["choices"][0]["logprobs"]["token_logprobs"][0]
            assert lp == pytest.approx(fake_logprob(choice_seed(9, best), 0))

    run(body)


def test_completion_logprobs_and_echo_shapes(model: Path) -> None:
    both = FakeWorker("both", TOKENS)

    async def body() -> None:
        async with router(model, [both], mode="colocated") as client:
            req = completion(max_tokens=3, logprobs=2, seed=3)
            data = await (await client.post("/v1/completions", json=req)).json()
            choice = data["choices"][0]
            lp = choice["logprobs"]
            assert lp["token_logprobs"] == [fake_logprob(3, i) for i in range(3)]
            assert len(lp["tokens"]) == 3 and all(isinstance(t, str) for t in lp["tokens"])
            assert all(len(top) <= 3 and lp["tokens"][i] in top
                       for i, top in enumerate(lp["top_logprobs"]))  # fmt: skip
            assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
            echo = await (await client.post("/v1/completions", json={**req, "echo": True})).json()
            e = echo["choices"][0]
            assert e["text"] == "hello" + choice["text"]
            n_prompt = echo["usage"]["prompt_tokens"]
            assert e["logprobs"]["token_logprobs"][0] is None
            assert e["logprobs"]["token_logprobs"][1:n_prompt] == [-0.5] * (n_prompt - 1)
            assert e["logprobs"]["token_logprobs"][n_prompt:] == lp["token_logprobs"]
            assert both.samplings[-1].prompt_logprobs == 2
            # max_tokens 0 with echo: the prompt alone (its logprobs), no completion token.
            only = await (
                await client.post("/v1/completions", json={**req, "echo": True, "max_tokens": 0})
            ).json()
            assert only["choices"][0]["text"] == "hello"
            assert only["usage"]["completion_tokens"] == 0
            assert len(only["choices"][0]["logprobs"]["tokens"]) == n_prompt

    run(body)


def test_chat_logprobs_through_the_disaggregated_handoff_and_a_migration(model: Path) -> None:
    """The first token's logprobs come from the prefill worker; after a decode worker dies
    mid-stream the survivor's logprobs continue, one per token, none lost or repeated."""
    prefill = FakeWorker("prefill", TOKENS)
    dying = FakeWorker("decode", TOKENS, cut_after_tokens=2)
    survivor = FakeWorker("decode", TOKENS, num_running=1)

    async def body() -> None:
        async with router(model, [prefill, dying, survivor]) as client:
            req = chat(max_tokens=6, logprobs=True, top_logprobs=2, seed=4)
            data = await (await client.post("/v1/chat/completions", json=req)).json()
            content = data["choices"][0]["logprobs"]["content"]
            assert [c["logprob"] for c in content] == [fake_logprob(4, i) for i in range(6)]
            assert all(len(c["top_logprobs"]) == 2 and c["bytes"] == list(c["token"].encode())
                       for c in content)  # fmt: skip
            assert [p for p, _ in survivor.calls if p != "/health"] == ["/generate"]

    run(body)


@pytest.mark.parametrize(
    ("patch", "ok"),
    [
        ({"tools": []}, True),
        ({"tool_choice": "none", "store": False, "metadata": {"a": "b"}}, True),
        ({"modalities": ["text"], "parallel_tool_calls": True}, True),
        ({"tool_choice": "auto"}, False),
        ({"functions": [{"name": "f"}]}, False),
        ({"audio": {"voice": "x"}}, False),
        ({"modalities": ["text", "audio"]}, False),
        ({"echo": True}, True),  # vLLM's chat echo (test_chat_echo.py)
        ({"mystery_field": 1}, False),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, False),
    ],
)
def test_chat_fields_are_served_or_refused_by_name(
    model: Path, patch: dict[str, object], ok: bool
) -> None:
    both = FakeWorker("both", TOKENS)

    async def body() -> None:
        async with router(model, [both], mode="colocated") as client:
            resp = await client.post("/v1/chat/completions", json=chat(**patch))
            data = await resp.json()
            if ok:
                assert resp.status == 200, data
                return
            assert resp.status == 400, data
            assert data["error"]["param"] == next(iter(patch))
            assert next(iter(patch)) in data["error"]["message"]

    run(body)


def test_unknown_fields_can_be_allowed_by_flag(model: Path) -> None:
    both = FakeWorker("both", TOKENS)

    async def body() -> None:
        async with router(model, [both], mode="colocated", allow_unknown_fields=True) as c:
            resp = await c.post("/v1/completions", json=completion(mystery_field=1))
            assert resp.status == 200
            # Known but unimplemented fields stay refused.
            resp = await c.post("/v1/completions", json=completion(suffix="x"))
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "suffix"

    run(body)


def test_content_parts_of_type_text_only(model: Path) -> None:
    both = FakeWorker("both", TOKENS)

    async def body() -> None:
        async with router(model, [both], mode="colocated") as client:
            parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
            req = chat(messages=[{"role": "user", "content": parts}])
            assert (await client.post("/v1/chat/completions", json=req)).status == 200
            image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
            req = chat(messages=[{"role": "user", "content": image}])
            resp = await client.post("/v1/chat/completions", json=req)
            err = (await resp.json())["error"]
            assert (
                resp.status == 400 and err["param"] == "messages" and "image_url" in err["message"]
            )

    run(body)


def test_tokenize_detokenize_version(model: Path) -> None:
    both = FakeWorker("both", TOKENS)

    async def body() -> None:
        async with router(model, [both], mode="colocated") as client:
            tok = await (await client.post("/tokenize", json={"prompt": "hello world"})).json()
            assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > 0
            back = await (await client.post("/detokenize", json={"tokens": tok["tokens"]})).json()
            assert back["prompt"] == "hello world"
            msgs = {"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True}
            chat_tok = await (await client.post("/tokenize", json=msgs)).json()
            assert len(chat_tok["token_strs"]) == chat_tok["count"]
            # The same ids the chat endpoint sends a worker.
            await client.post("/v1/chat/completions", json=chat())
            usage = (await (await client.post("/v1/chat/completions", json=chat())).json())["usage"]
            assert usage["prompt_tokens"] == chat_tok["count"]
            bad = await client.post("/detokenize", json={"tokens": [10**9]})
            assert bad.status == 400 and (await bad.json())["error"]["param"] == "tokens"
            extra = await client.post("/tokenize", json={"prompt": "x", "nope": 1})
            assert extra.status == 400 and (await extra.json())["error"]["param"] == "nope"
            version = await (await client.get("/version")).json()
            assert isinstance(version["version"], str) and version["version"]

    run(body)


def test_served_model_names_and_max_model_len(model: Path) -> None:
    both = FakeWorker("both", TOKENS)

    async def body() -> None:
        async with router(model, [both], mode="colocated", served_model_names=("a", "b"),
                          max_model_len=64) as client:  # fmt: skip
            models = await (await client.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["a", "b"]
            assert models["data"][0]["max_model_len"] == 64
            resp = await client.post("/v1/completions", json=completion(model="b"))
            assert resp.status == 200 and (await resp.json())["model"] == "b"
            resp = await client.post("/v1/completions", json=completion())  # tiny-v2
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "model"
            resp = await client.post("/v1/completions", json=completion(model="a", max_tokens=70))
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "max_tokens"

    run(body)


def test_structured_output_without_the_extra_is_a_400_naming_it(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    from pdserve.engine import grammar

    real = importlib.import_module

    def no_llguidance(name: str, *args: object) -> object:
        if name == "llguidance":
            raise ImportError("No module named 'llguidance'")
        return real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(grammar.importlib, "import_module", no_llguidance)
    both = FakeWorker("both", TOKENS)

    async def body() -> None:
        async with router(model, [both], mode="colocated") as client:
            req = chat(response_format={"type": "json_object"})
            resp = await client.post("/v1/chat/completions", json=req)
            err = (await resp.json())["error"]
            assert resp.status == 400 and err["param"] == "response_format"
            assert "pdserve[grammar]" in err["message"]
            assert both.paths() == []

    run(body)


def test_chat_template_override(model: Path, tmp_path: Path) -> None:
    both = FakeWorker("both", TOKENS)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")

    async def body() -> None:
        async with router(model, [both], mode="colocated", chat_template=str(template)) as c:
            msgs = {"messages": [{"role": "user", "content": "hi"}]}
            ids = (await (await c.post("/tokenize", json=msgs)).json())["tokens"]
            text = (await (await c.post("/detokenize", json={"tokens": ids})).json())["prompt"]
            assert text == "<<hi>>"
            # The chat endpoint renders the same template.
            usage = (await (await c.post("/v1/chat/completions", json=chat())).json())["usage"]
            assert usage["prompt_tokens"] == len(ids)

    run(body)
