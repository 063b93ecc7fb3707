"""vLLM's POST /v1/chat/completions/batch: several conversations in one request, one choice each.

The body is a chat completion request whose `messages` is a list of conversations (each a list
of messages); every other field applies to each conversation. Conversation i is built by the
chat path's own builder (template, sampling, structured output, context length: the same 400s,
a conversation's own naming it) and runs as its own flow `<id>-<i>`, colocated or
disaggregated, with its own placement, handoff and recovery, exactly as a single chat request.
The answer is one `chat.completion` whose choice i answers conversation i (its role and echo
are that conversation's), with the usage summed over all of them. If one conversation fails,
the others are closed (their workers released) and the failure is the request's, as for `n`.

Limits, as vLLM's (vllm/entrypoints/openai/chat_completion/batch_serving.py and its
`BatchChatCompletionRequest`): not streamed, no tools, `n` 1. pdserve also refuses
`prompt_logprobs` (the response has one `prompt_logprobs` and the batch several prompts; vLLM
takes the field and answers none) and caps a batch at `MAX_PROMPTS` conversations, as it caps
a completions request's list of prompts. As in vLLM's batch answer, the response carries no
`prompt_token_ids` (several prompts); with `return_token_ids` each choice has its `token_ids`.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from pdserve.errors import InvalidRequest
from pdserve.router.api import responses
from pdserve.router.api.chat_render import ChatRender
from pdserve.router.api.fanout import ChoiceRun
from pdserve.router.api.logprobs_format import TokenTexts
from pdserve.router.api.openai_models import ChatCompletionResponse, PromptTokensDetails, Usage
from pdserve.router.api.request_builder import MAX_PROMPTS, RequestBuilder
from pdserve.router.api.responses import ChoiceResult, Job

# Fields the batch endpoint refuses when set to anything but their default: why, per field.
_REFUSED: dict[str, tuple[Any, str]] = {
    "stream": (False, "the batch endpoint answers whole (use /v1/chat/completions to stream)"),
    "n": (1, "the batch endpoint answers one choice per conversation"),
    "tools": (None, "tool calling is served by /v1/chat/completions"),
    "tool_choice": ("none", "tool calling is served by /v1/chat/completions"),
    "prompt_logprobs": (None, "the batch answer has no room for several prompts' logprobs"),
}


@dataclass(frozen=True, slots=True)
class ChatBatch:
    """A validated batch: the request as a whole (its id, creation time, body) and one chat
    job per conversation (`parts[i]` answers conversation i)."""

    job: Job
    parts: list[Job]

    def render(self, texts: TokenTexts) -> BatchRenderFactory:
        """What writes this batch's answer (the `serve` render factory)."""
        return BatchRenderFactory(self, texts)


def build(builder: RequestBuilder, data: dict[str, Any]) -> ChatBatch:
    """A POST /v1/chat/completions/batch body as a batch; InvalidRequest (400) naming the field
    otherwise."""
    conversations = data.get("messages")
    if (
        not isinstance(conversations, list)
        or not conversations
        or not all(isinstance(c, list) for c in conversations)
    ):
        raise InvalidRequest(
            "messages: the batch endpoint takes a non-empty list of conversations, each a list"
            " of messages",
            "messages",
        )
    if len(conversations) > MAX_PROMPTS:
        raise InvalidRequest(
            f"messages: at most {MAX_PROMPTS} conversations per batch, got {len(conversations)}",
            "messages",
        )
    for name, (default, why) in _REFUSED.items():
        value = data.get(name)
        if value not in (None, default, []):
            raise InvalidRequest(f"{name}: not supported here ({why}); got {value!r}", name)
    batch_id = f"chatcmpl-{uuid.uuid4().hex}"
    parts = []
    for i, conversation in enumerate(conversations):
        try:
            parts.append(builder.chat({**data, "messages": conversation}, f"{batch_id}-{i}"))
        except InvalidRequest as exc:
            if i == 0 and not _own(exc):
                raise  # a field every conversation shares: the batch's own error
            raise InvalidRequest(f"conversation {i}: {exc.message}", exc.param, exc.code) from exc
    # The request as a whole: the first conversation's body and sampling, the batch's id.
    return ChatBatch(dataclasses.replace(parts[0], request_id=batch_id), parts)


class BatchRender(ChatRender):
    """Writes a batch's answer: each conversation's choice as the chat path writes it."""

    def __init__(self, batch: ChatBatch, texts: TokenTexts, runs: Sequence[ChoiceRun]) -> None:
        super().__init__(batch.job, texts, runs)
        self._batch = batch
        # One run per conversation (n = 1), in conversation order: choice i is conversation i.
        for i, run in enumerate(runs):
            run.result.index = i

    def whole(self, chosen: Sequence[ChoiceResult]) -> BaseModel:
        """One chat.completion: choice i from conversation i, the usage summed."""
        answers = []
        for part, choice in zip(self._batch.parts, chosen, strict=True):
            answer = responses.whole(part, [choice], self._texts)
            assert isinstance(answer, ChatCompletionResponse)
            answers.append(answer)
        job = self._batch.job
        return ChatCompletionResponse(
            id=job.request_id,
            created=job.created,
            model=job.body.model,
            choices=[a.choices[0] for a in answers],
            usage=_total([a.usage for a in answers]),
        )


@dataclass(frozen=True, slots=True)
class BatchRenderFactory:
    """Makes the batch's render for `serve` (which passes the batch's job and runs)."""

    batch: ChatBatch
    texts: TokenTexts

    def __call__(self, job: Job, runs: list[ChoiceRun]) -> BatchRender:
        return BatchRender(self.batch, self.texts, runs)


def _own(exc: InvalidRequest) -> bool:
    """Whether a refusal is about a conversation itself (its messages, its length), not about
    a field every conversation shares (any refusal after the first conversation is)."""
    return exc.param == "messages" or exc.code == "context_length_exceeded"


def _total(usages: Sequence[Usage]) -> Usage:
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages if u.prompt_tokens_details)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )
