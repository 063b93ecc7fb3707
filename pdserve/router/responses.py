"""OpenAI response bodies for one request: whole responses, streamed chunks, errors. Pure.

`Job` is a validated request on its way through a flow (what every builder needs: id,
creation time, the client's body, the prompt and the sampling). Completion chunks reuse the
`text_completion` object as OpenAI does; chat chunks carry a `delta`, the role on the first
one; a usage chunk (`stream_options.include_usage`) has no choices.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from pdserve.router.openai_models import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    SamplingFields,
    Usage,
)
from pdserve.router.output import OutputStream
from pdserve.worker.protocol import SamplingModel


@dataclass(slots=True)
class Job:
    """One validated request on its way through a flow."""

    kind: str  # "completion" or "chat"
    request_id: str
    created: int
    body: SamplingFields
    prompt_token_ids: list[int]
    sampling: SamplingModel

    def usage(self, output: OutputStream) -> Usage:
        """Token counts once the output is complete."""
        n = len(self.prompt_token_ids)
        return Usage(
            prompt_tokens=n, completion_tokens=output.num_tokens, total_tokens=n + output.num_tokens
        )


def chunk(
    job: Job, text: str, finish_reason: str | None, token_ids: list[int] | None = None
) -> BaseModel:
    """One streamed chunk adding `text` (finish_reason on the last); `token_ids` when asked."""
    ids = token_ids if job.body.return_token_ids else None
    if job.kind == "chat":
        return chat_chunk(job, ChatDelta(content=text), finish_reason, token_ids=ids)
    choice = CompletionChoice(text=text, finish_reason=finish_reason, token_ids=ids)
    return CompletionResponse(
        id=job.request_id, created=job.created, model=job.body.model, choices=[choice]
    )


def chat_chunk(
    job: Job,
    delta: ChatDelta | None,
    finish_reason: str | None = None,
    usage: Usage | None = None,
    token_ids: list[int] | None = None,
) -> ChatCompletionChunk:
    """A chat chunk: a delta, or (delta None) the usage chunk with no choices."""
    choices = (
        []
        if delta is None
        else [ChatChunkChoice(delta=delta, finish_reason=finish_reason, token_ids=token_ids)]
    )
    return ChatCompletionChunk(
        id=job.request_id, created=job.created, model=job.body.model, choices=choices,
        usage=usage,
    )  # fmt: skip


def whole(job: Job, text: str, output: OutputStream) -> BaseModel:
    """The non-streamed response."""
    usage = job.usage(output)
    ids = list(output.token_ids) if job.body.return_token_ids else None
    if job.kind == "chat":
        choice = ChatChoice(
            message=ChatMessageOut(content=text), finish_reason=output.finish_reason,
            token_ids=ids,
        )  # fmt: skip
        return ChatCompletionResponse(
            id=job.request_id, created=job.created, model=job.body.model,
            choices=[choice], usage=usage,
        )  # fmt: skip
    return CompletionResponse(
        id=job.request_id, created=job.created, model=job.body.model,
        choices=[CompletionChoice(text=text, finish_reason=output.finish_reason, token_ids=ids)],
        usage=usage,
    )  # fmt: skip


def usage_chunk(job: Job, output: OutputStream) -> BaseModel:
    """The final streamed chunk of `stream_options.include_usage`: no choices, the usage."""
    usage = job.usage(output)
    if job.kind == "chat":
        return chat_chunk(job, None, usage=usage)
    return CompletionResponse(
        id=job.request_id, created=job.created, model=job.body.model, choices=[], usage=usage
    )


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None,
    code: str | None = None,
) -> ErrorResponse:  # fmt: skip
    """The OpenAI error object as a model."""
    return ErrorResponse(error=ErrorDetail(message=message, type=type_, param=param, code=code))
