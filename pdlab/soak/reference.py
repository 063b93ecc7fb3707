"""The soak's requests made concrete, each with its fault-free reference.

A planned request becomes a `Prepared` one: the HTTP body to send and the tokens and text a
fault-free run returns. References come from one in-process engine (`pdserve.LLM`, the same
model and block size as the workers), a session's turns level by level: turn k's prompt is
turn k-1's prompt + turn k-1's *reference* output + this turn's new part (for chat: the
messages so far, the reference answer as the assistant's message, then the new user message).
So every turn's prompt is fixed before the soak starts, whatever happened to the turn before
it, and every request has one right answer. The expected text is what the router's own
`OutputStream` makes of the reference tokens (EOS, detokenization, max_tokens), so it is
compared with what clients receive by the same rules.

Sampling is keyed by (seed, token index), so a greedy or seeded request draws the same
tokens on any engine, with one caveat measured in the soak: the engine's numerics depend on
the batch (padded decode attention, matmul shapes), so at a near-tie of the two best tokens a
request can take the other branch in another batch. Either branch is a correct fault-free
output: `alone` computes a request by itself (one request in the engine, no prefix cache), the
second opinion the soak asks for each request whose output differs from the batched reference.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdlab.soak.plan import Api, PlannedRequest, malformed_case
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling import SamplingParams
from pdserve.text.output import OutputStream

PATHS = {Api.COMPLETIONS: "/v1/completions", Api.CHAT: "/v1/chat/completions"}


@dataclass(frozen=True, slots=True)
class Prepared:
    """A planned request ready to send, and what it must give."""

    planned: PlannedRequest
    path: str
    body: bytes
    expected_token_ids: tuple[int, ...] = ()
    expected_text: str = ""
    # For a malformed request: the `param` its 400 names (None: none).
    expected_param: str | None = None
    # The prompt as the router tokenizes it (empty for a malformed request).
    prompt_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class _Conversation:
    prompt_token_ids: list[int]
    messages: list[dict[str, str]]


def _params(r: PlannedRequest) -> SamplingParams:
    return SamplingParams(
        max_tokens=r.max_tokens, temperature=r.temperature, seed=r.seed, ignore_eos=r.ignore_eos
    )


def _body(r: PlannedRequest, model: str, conversation: _Conversation) -> bytes:
    body: dict[str, object] = {
        "model": model,
        "max_tokens": r.max_tokens,
        "temperature": r.temperature,
        "ignore_eos": r.ignore_eos,
        "stream": r.stream,
        "return_token_ids": True,
    }
    if r.seed is not None:
        body["seed"] = r.seed
    if r.session is not None:
        body["user"] = r.session
    if r.api is Api.CHAT:
        body["messages"] = conversation.messages
    else:
        body["prompt"] = conversation.prompt_token_ids
    return json.dumps(body).encode()


def prepare(
    plan: Sequence[PlannedRequest], model_path: Path, max_model_len: int, block_size: int = 16
) -> list[Prepared]:
    """Every request of `plan` with its body and reference (see the module docstring).

    A session turn whose prompt would no longer fit the context with its max_tokens is dropped
    with the turns after it.
    """
    from pdserve.llm import LLM  # the engine loads torch: only when references are made

    tokenizer = Tokenizer(model_path)
    llm = LLM(str(model_path), block_size=block_size)
    model = model_path.name
    out: dict[int, Prepared] = {}
    conversations: dict[str, _Conversation] = {}
    ended: set[str] = set()
    for r in plan:
        if r.malformed is not None:
            case = malformed_case(r.malformed, model, max_model_len)
            out[r.index] = Prepared(r, PATHS[case.api], case.body, expected_param=case.param)
    level = [r for r in plan if r.malformed is None and r.turn == 0]
    turn = 0
    while level:
        batch: list[tuple[PlannedRequest, _Conversation, list[int]]] = []
        for r in level:
            if r.session in ended:
                continue
            conversation = _next_turn(r, conversations.get(r.session or ""))
            ids = (
                tokenizer.encode_chat(conversation.messages)
                if r.api is Api.CHAT
                else conversation.prompt_token_ids
            )
            if len(ids) + r.max_tokens >= max_model_len:
                if r.session is not None:
                    ended.add(r.session)
                continue
            batch.append((r, conversation, ids))
        results = llm.generate([ids for _, _, ids in batch], [_params(r) for r, _, _ in batch])
        for (r, conversation, ids), result in zip(batch, results, strict=True):
            tokens = tuple(result.token_ids)
            text = _text(tokenizer, r, tokens)
            body = _body(r, model, conversation)
            out[r.index] = Prepared(r, PATHS[r.api], body, tokens, text, None, tuple(ids))
            if r.session is not None:
                conversation.prompt_token_ids = [*conversation.prompt_token_ids, *tokens]
                conversation.messages = [
                    *conversation.messages,
                    {"role": "assistant", "content": text},
                ]
                conversations[r.session] = conversation
        turn += 1
        level = [r for r in plan if r.malformed is None and r.turn == turn]
    return [out[r.index] for r in plan if r.index in out]


def _next_turn(r: PlannedRequest, before: _Conversation | None) -> _Conversation:
    """The conversation as this request sends it: the earlier turns, then its new part."""
    ids = list(before.prompt_token_ids) if before else []
    messages = list(before.messages) if before else []
    return _Conversation(
        [*ids, *r.new_token_ids], [*messages, {"role": "user", "content": r.new_text}]
    )


def _text(tokenizer: Tokenizer, r: PlannedRequest, tokens: Sequence[int]) -> str:
    """The text the router sends for `tokens` (its own output rules)."""
    sampling = _params(r)
    output = OutputStream(tokenizer, sampling, tokenizer.eos_token_ids)
    text = output.add_all(list(tokens))
    if not output.finished:
        text += output.finish("length" if len(tokens) >= r.max_tokens else "stop")
    return text


def alone(
    requests: Sequence[Prepared], model_path: Path, block_size: int = 16
) -> dict[int, tuple[tuple[int, ...], str]]:
    """Each request computed by itself: index -> (tokens, text as the router sends them)."""
    from pdserve.llm import LLM

    tokenizer = Tokenizer(model_path)
    llm = LLM(str(model_path), block_size=block_size, enable_prefix_caching=False)
    out: dict[int, tuple[tuple[int, ...], str]] = {}
    for p in requests:
        (result,) = llm.generate([list(p.prompt_token_ids)], [_params(p.planned)])
        tokens = tuple(result.token_ids)
        out[p.planned.index] = (tokens, _text(tokenizer, p.planned, tokens))
    return out
