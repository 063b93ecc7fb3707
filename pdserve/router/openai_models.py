"""OpenAI-compatible request and response bodies (completions, chat completions, models).

Requests ignore fields pdserve does not implement (clients send many optional ones) but type
check every field it does; value ranges are checked when the sampling parameters are built
(`openai_api`), so each error names its field as the OpenAI `param`. `top_k` and `ignore_eos`
are extensions (as in vLLM). Only `n == 1` is served.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    """`stream_options`: only include_usage is honoured."""

    include_usage: bool = False


class SamplingFields(_Request):
    """Fields common to completions and chat completions."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # Extension (as in vLLM): keep generating past the model's EOS token.
    ignore_eos: bool = False
    # Extension (as in vLLM): each choice also carries the completion's token ids.
    return_token_ids: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = 1

    def stop_list(self) -> list[str]:
        """`stop` as a list (a single string is one stop string)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """True when a streamed response must end with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    # Text, or token ids already encoded.
    prompt: str | list[int]


class ChatMessage(_Request):
    """One message of a chat; `content` is text only."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    # The newer name of max_tokens; wins when both are given.
    max_completion_tokens: int | None = None


class Usage(BaseModel):
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    """A choice of a completion, whole or as a streamed chunk."""

    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    # Only with `return_token_ids`: the tokens this choice (or chunk) adds.
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)


class CompletionResponse(BaseModel):
    """A completion, or (object unchanged, as OpenAI does) one chunk of a streamed one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    """The assistant's message of a whole chat completion."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """A choice of a whole chat completion."""

    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatCompletionResponse(BaseModel):
    """A whole chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """What a chat chunk adds: the role on the first chunk, then content."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    """A choice of one streamed chat chunk."""

    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatCompletionChunk(BaseModel):
    """One streamed chat chunk; the usage chunk has no choices."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """One entry of GET /v1/models."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int


class ModelList(BaseModel):
    """GET /v1/models."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    """The OpenAI error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error answer: {"error": {...}}."""

    error: ErrorDetail
