"""The soak's prepared requests: each body carries the prompt its reference was computed from,
a session's turn is built from the previous turn's reference, and a request computed alone
gives the same tokens (the tiny engine; a few seconds)."""

from __future__ import annotations

import json
from pathlib import Path

from pdlab.soak.plan import Api, plan_load
from pdlab.soak.reference import alone, prepare
from pdserve.model.tokenizer import Tokenizer


def test_bodies_prompts_and_session_turns_agree(tiny_model_path: Path) -> None:
    # Seed 32: 12 requests, both APIs, sessions of both, a malformed one, no long prompt.
    plan = plan_load(32, 10, 1.0)
    prepared = prepare(plan, tiny_model_path, max_model_len=2048)
    tokenizer = Tokenizer(tiny_model_path)
    assert {p.planned.api for p in prepared} == {Api.CHAT, Api.COMPLETIONS}
    by_index = {p.planned.index: p for p in prepared}
    for p in prepared:
        body = json.loads(p.body)
        if p.planned.malformed is not None:
            assert p.prompt_token_ids == () and p.expected_token_ids == ()
            continue
        prompt = (
            tokenizer.encode_chat(body["messages"]) if p.planned.api is Api.CHAT else body["prompt"]
        )
        assert list(p.prompt_token_ids) == prompt
        assert body["max_tokens"] == p.planned.max_tokens and body["return_token_ids"]
        assert 0 < len(p.expected_token_ids) <= p.planned.max_tokens
        if p.planned.turn and p.planned.api is Api.COMPLETIONS:
            before = next(
                q
                for q in by_index.values()
                if q.planned.session == p.planned.session and q.planned.turn == p.planned.turn - 1
            )
            history = [*before.prompt_token_ids, *before.expected_token_ids]
            assert list(p.prompt_token_ids[: len(history)]) == history
        if p.planned.turn and p.planned.api is Api.CHAT:
            assert body["messages"][-2]["role"] == "assistant"
    assert any(p.planned.turn for p in prepared) and any(p.planned.malformed for p in prepared)
    sample = [p for p in prepared if p.planned.malformed is None][:4]
    computed = alone(sample, tiny_model_path)
    assert [computed[p.planned.index] for p in sample] == [
        (p.expected_token_ids, p.expected_text) for p in sample
    ]
