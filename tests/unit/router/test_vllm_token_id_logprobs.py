"""vLLM's `return_tokens_as_token_ids` (issue 33), on fake workers, colocated and disaggregated:
logprob tokens written `token_id:N`. Each test names the vLLM test it re-expresses
(tests/entrypoints/openai/test_return_tokens_as_ids.py, chat_completion/
test_batched_chat_completions.py); our own tests, not copies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from router_harness import completion, router, run
from vllm_cases import MODES, TOKENS, chat, events, workers

from pdserve.model.tokenizer import Tokenizer


def ids_of(names: list[str]) -> list[int]:
    """The token ids `token_id:N` names stand for (each must be one)."""
    assert all(n.startswith("token_id:") for n in names), names
    return [int(n.removeprefix("token_id:")) for n in names]


@MODES
def test_completion_tokens_as_token_ids(tiny_model_path: Path, mode: str) -> None:
    """test_completion_return_tokens_as_token_ids_completion: with `echo` and `logprobs: 1`,
    every token (the prompt's too) is `token_id:N`, each position's top_logprobs key is the
    token itself (the first position has none), and the ids decode to the choice's text;
    whole and streamed alike."""
    tokenizer = Tokenizer(tiny_model_path)

    async def body() -> None:
        async with router(tiny_model_path, workers(mode), mode=mode) as client:
            req = completion(prompt="Say 'Hello, world!'", echo=True, logprobs=1,
                             return_tokens_as_token_ids=True)  # fmt: skip
            data = await (await client.post("/v1/completions", json=req)).json()
            choice = data["choices"][0]
            lp = choice["logprobs"]
            tokens: list[str] = lp["tokens"]
            assert lp["top_logprobs"][0] is None
            assert tokens[1:] == [next(iter(top)) for top in lp["top_logprobs"][1:]]
            ids = ids_of(tokens)
            assert ids[-4:] == TOKENS[:4]
            assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True)
            resp = await client.post("/v1/completions", json={**req, "stream": True})
            chunks = [c["choices"][0] for c in events(await resp.read()) if c["choices"]]
            streamed = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
            assert streamed == tokens
            assert "".join(c["text"] for c in chunks) == choice["text"]

    run(body)


@MODES
def test_chat_tokens_as_token_ids(tiny_model_path: Path, mode: str) -> None:
    """test_chat_return_tokens_as_token_ids_completion: the chat logprobs' tokens are
    `token_id:N` and decode to the message's content; the alternatives (`top_logprobs: 2`)
    are named so too, and each `bytes` holds its name's UTF-8, as vLLM writes them. Without
    the field, tokens are their text."""
    tokenizer = Tokenizer(tiny_model_path)

    async def body() -> None:
        async with router(tiny_model_path, workers(mode), mode=mode) as client:
            req = chat(logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)
            for stream in (False, True):
                resp = await client.post("/v1/chat/completions", json={**req, "stream": stream})
                if stream:
                    chunks = [c["choices"][0] for c in events(await resp.read()) if c["choices"]]
                    content = [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]]
                    text = "".join(c["delta"].get("content") or "" for c in chunks)
                else:
                    choice = (await resp.json())["choices"][0]
                    content, text = choice["logprobs"]["content"], choice["message"]["content"]
                assert ids_of([e["token"] for e in content]) == TOKENS[:4]
                assert tokenizer.decode(ids_of([e["token"] for e in content])) == text
                for entry in content:
                    assert len(entry["top_logprobs"]) == 2
                    ids_of([top["token"] for top in entry["top_logprobs"]])
                    assert bytes(entry["bytes"]).decode() == entry["token"]
            plain = await (
                await client.post("/v1/chat/completions", json=chat(logprobs=True))
            ).json()
            tokens = [e["token"] for e in plain["choices"][0]["logprobs"]["content"]]
            assert tokens == [tokenizer.decode([t]) for t in TOKENS[:4]]

    run(body)


@MODES
def test_batch_tokens_as_token_ids(tiny_model_path: Path, mode: str) -> None:
    """test_batched_chat_completions_return_tokens_as_token_ids: through the batch endpoint,
    with `logprobs` and `top_logprobs: 1`, every logprob token is a `token_id:N` name."""

    async def body() -> None:
        async with router(tiny_model_path, workers(mode), mode=mode) as client:
            conversations: list[Any] = [[{"role": "user", "content": "alpha"}]]
            req = chat(messages=conversations, logprobs=True, top_logprobs=1,
                       return_tokens_as_token_ids=True)  # fmt: skip
            resp = await client.post("/v1/chat/completions/batch", json=req)
            data = await resp.json()
            assert resp.status == 200, json.dumps(data)
            content = data["choices"][0]["logprobs"]["content"]
            assert ids_of([e["token"] for e in content]) == TOKENS[:4]

    run(body)


def test_router_flag_sets_the_default(tiny_model_path: Path) -> None:
    """test_return_tokens_as_ids.py's server fixture (`--return-tokens-as-token-ids`): with the
    router's flag, a request that does not send the field gets `token_id:N` names; one that
    sends `return_tokens_as_token_ids: false` gets token texts."""
    tokenizer = Tokenizer(tiny_model_path)

    async def body() -> None:
        async with router(tiny_model_path, workers("colocated"), mode="colocated",
                          return_tokens_as_token_ids=True) as client:  # fmt: skip
            data = await (await client.post("/v1/completions", json=completion(logprobs=0))).json()
            assert ids_of(data["choices"][0]["logprobs"]["tokens"]) == TOKENS[:4]
            req = chat(logprobs=True, return_tokens_as_token_ids=False)
            data = await (await client.post("/v1/chat/completions", json=req)).json()
            tokens = [e["token"] for e in data["choices"][0]["logprobs"]["content"]]
            assert tokens == [tokenizer.decode([t]) for t in TOKENS[:4]]

    run(body)
