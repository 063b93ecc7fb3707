"""Logprobs in the shapes OpenAI (and vLLM's server) return them. Pure.

Completions: `{tokens, token_logprobs, top_logprobs, text_offset}`, one entry per token of the
choice's text; with `echo` the prompt's tokens come first and the very first prompt token has
`None` (nothing predicts it). `top_logprobs` maps token text to logprob for the chosen token
(first) and the requested number of alternatives (as vLLM does). Chat: `{content: [{token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}]}]}` with exactly `top_logprobs` alternatives.

A token's text is its own decode (special tokens included), so a byte-level token holding part
of a UTF-8 character reads as U+FFFD, as in vLLM; with vLLM's `return_tokens_as_token_ids` a
token is written `token_id:N` instead (`token_id_name`), and a chat token's `bytes` are those of
that name, as vLLM writes them. Values are the worker's float32 logprobs
unchanged, floored at -9999.0 (vLLM's floor) so JSON never carries -inf.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.worker_api import LogprobModel
from pdserve.router.api.openai_models import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprob,
)

_FLOOR = -9999.0

# How a logprob entry names a token: its text (`TokenTexts`) or its id (`token_id_name`).
TokenName = Callable[[int], str]


def token_id_name(token_id: int) -> str:
    """A token as vLLM's `return_tokens_as_token_ids` names it."""
    return f"token_id:{token_id}"


class TokenTexts:
    """Each token id's own text, decoded once."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 200_000:
                self._cache[token_id] = text
        return text


def _value(logprob: float) -> float:
    return max(logprob, _FLOOR)


def completion_logprobs(
    texts: TokenName,
    token_ids: Sequence[int],
    entries: Sequence[LogprobModel | None],
    text_offsets: Sequence[int],
) -> CompletionLogprobs:
    """The completions `logprobs` object for `token_ids` (entry None: no logprob there)."""
    tokens = [texts(t) for t in token_ids]
    top: list[dict[str, float] | None] = []
    for token, entry in zip(tokens, entries, strict=True):
        if entry is None:
            top.append(None)
            continue
        # The token itself first, then the alternatives, as vLLM orders them (its logprobs
        # dict holds the sampled or prompt token before the top ones).
        alternatives = {token: _value(entry.logprob)}
        for t, v in zip(entry.top_token_ids, entry.top_logprobs, strict=True):
            alternatives.setdefault(texts(t), _value(v))
        top.append(alternatives)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if e is None else _value(e.logprob) for e in entries],
        top_logprobs=top,
        text_offset=list(text_offsets),
    )


def _top(texts: TokenName, token_id: int, logprob: float) -> ChatTopLogprob:
    text = texts(token_id)
    return ChatTopLogprob(token=text, logprob=_value(logprob), bytes=list(text.encode()))


def chat_logprobs(texts: TokenName, entries: Sequence[LogprobModel]) -> ChatLogprobs:
    """The chat `logprobs` object for output tokens with these entries."""
    content = []
    for e in entries:
        top = [_top(texts, t, v) for t, v in zip(e.top_token_ids, e.top_logprobs, strict=True)]
        chosen = _top(texts, e.token_id, e.logprob)
        content.append(
            ChatTokenLogprob(
                token=chosen.token, logprob=chosen.logprob, bytes=chosen.bytes, top_logprobs=top
            )
        )
    return ChatLogprobs(content=content)


def prompt_logprobs(
    texts: TokenTexts, token_ids: Sequence[int], entries: Sequence[LogprobModel], num_top: int
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs` for a prompt of `token_ids` whose positions 1.. have `entries`
    (position 0 has none); `num_top` alternatives each, then the prompt's token if not among
    them."""
    out: list[dict[str, PromptLogprob] | None] = [None]
    for token_id, e in zip(token_ids[1:], entries, strict=False):
        position: dict[str, PromptLogprob] = {}
        top = list(zip(e.top_token_ids, e.top_logprobs, strict=True))[:num_top]
        for rank, (t, v) in enumerate(top, start=1):
            position[str(t)] = PromptLogprob(logprob=_value(v), rank=rank, decoded_token=texts(t))
        if str(token_id) not in position:
            position[str(token_id)] = PromptLogprob(
                logprob=_value(e.logprob), rank=None, decoded_token=texts(token_id)
            )
        out.append(position)
    return out
