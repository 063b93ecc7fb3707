"""OpenAI-compatible request and response bodies (completions, chat completions, models).

Requests are strict: every field is typed, nested objects forbid unknown keys, and the
top-level keys are checked before validation by `field_policy` (an unknown field, or an OpenAI
field pdserve does not implement, is a 400 naming it). Value ranges are checked when the
sampling parameters are built (`request_builder`), so each error names its field as the
OpenAI `param`. Fields marked "extension" are vLLM's (same names, same meaning).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    """`stream_options`."""

    # End the stream with a chunk carrying the usage and no choices.
    include_usage: bool = False
    # Extension (vLLM): every chunk also carries the usage so far.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Request):
    """`response_format.json_schema`."""

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    # pdserve always follows the schema exactly; `strict` changes nothing.
    strict: bool | None = None


class ResponseFormat(_Request):
    """`response_format`: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """`structured_outputs`, vLLM's newer form of the guided_* fields: one of its keys (a key
    vLLM has beyond these, e.g. `whitespace_pattern`, is refused by name)."""

    # `json` on the wire (the attribute name would shadow BaseModel.json).
    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # As response_format {"type": "json_object"}: any JSON object.
    json_object: bool | None = None


class SamplingFields(_Request):
    """Fields common to completions and chat completions."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    # Extension: keep the k most likely tokens (0 or -1: all).
    top_k: int = 0
    # Extension: drop tokens below min_p times the most likely one's probability.
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Extension: > 1 discourages tokens already in the prompt or output.
    repetition_penalty: float = 1.0
    # Token id (as a string key, as OpenAI sends it) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    # Extension: EOS and stop tokens cannot end the output before this many tokens.
    min_tokens: int = 0
    # Extension: keep generating past the model's EOS token.
    ignore_eos: bool = False
    # Extension: each choice also carries the completion's token ids.
    return_token_ids: bool = False
    # Extension (vLLM's): logprob tokens written `token_id:N` instead of their text (a token
    # that is part of a UTF-8 character stays identifiable); None: the router's
    # --return-tokens-as-token-ids decides (the builder fills it in).
    return_tokens_as_token_ids: bool | None = None
    # Extension (vLLM's): with logprobs, each token's alternatives are these tokens (and the
    # chosen one) instead of the most likely ones.
    logprob_token_ids: list[int] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    # Extension: token ids that end the output (the token counts, adds no text).
    stop_token_ids: list[int] | None = None
    # Extension: keep the stop string that ended the output in the text.
    include_stop_str_in_output: bool = False
    # Extension: decode special tokens into the text too.
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = 1
    response_format: ResponseFormat | None = None
    # Extensions (vLLM's guided decoding): at most one of these or a JSON response_format.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Extension (vLLM's current name for the same): at most one structured-output request.
    structured_outputs: StructuredOutputs | None = None

    def stop_list(self) -> list[str]:
        """`stop` as a list (a single string is one stop string)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """True when a streamed response must end with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """True when every streamed chunk carries the usage so far: vLLM's rule, both
        `include_usage` and `continuous_usage_stats`."""
        return (
            self.include_usage
            and self.stream_options is not None
            and (self.stream_options.continuous_usage_stats)
        )


# A prompt: text, token ids, or a batch of either (each its own choices).
Prompt = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: Prompt
    # Prepend the prompt to each choice's text (and its logprobs, with `logprobs`).
    echo: bool = False
    # Logprobs of each output token and of this many alternatives (0..20).
    logprobs: int | None = None
    # Sample this many per prompt and return the `n` with the highest total logprob.
    best_of: int | None = None
    # Extension (vLLM's): each prompt token's logprob and this many alternatives (0..20), on
    # each choice as `prompt_logprobs`; not with stream (as in vLLM).
    prompt_logprobs: int | None = None


class ContentPart(_Request):
    """A content part as sent; only `{"type": "text", "text": ...}` is served, any other
    type is refused naming it (`request_builder`)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(_Request):
    """A call's function: its name and its arguments as a JSON string."""

    name: str
    arguments: str


class ToolCall(_Request):
    """A tool call an assistant message made (sent back in the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    """One message of a chat; content is text or a list of text parts. As in vLLM, any role
    and any further keys are taken and handed to the chat template, which decides what they
    mean (a template that does not know a role may refuse it: a 400 naming messages)."""

    # Keys beyond these reach the template as they are.
    model_config = ConfigDict(extra="allow")
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # Assistant messages: the calls it made; tool messages: the call this result answers.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # Sent back by clients as the assistant answered it; carries nothing to render.
    refusal: str | None = None

    def text(self) -> str | None:
        """The content as one string: text parts joined by newlines (as vLLM's string
        content format does); None when the message has no content. Parts other than text
        are refused before this is called (`request_builder`)."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(p.text or "" for p in self.content)


class FunctionDefinition(_Request):
    """A function tool: its name, what it does, and its parameters as a JSON schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # pdserve follows the schema exactly whenever a call is forced; `strict` changes nothing.
    strict: bool | None = None


class ToolDefinition(_Request):
    """One entry of `tools` (function tools only, as in OpenAI's chat API)."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    """`tool_choice.function`."""

    name: str


class NamedToolChoice(_Request):
    """`tool_choice` naming the one function the model must call."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    # The newer name of max_tokens; wins when both are given.
    max_completion_tokens: int | None = None
    # Logprobs of each output token; `top_logprobs` alternatives (0..20) with it.
    logprobs: bool = False
    top_logprobs: int | None = None
    # Extension: end the prompt with the assistant turn's opening (the template's).
    add_generation_prompt: bool = True
    # Extension: the final (assistant) message is left open, and the model continues it.
    continue_final_message: bool = False
    # Extension (vLLM's): each choice's content starts with the final message's text when that
    # message has the answer's role (with add_generation_prompt false: always).
    echo: bool = False
    # Extension (vLLM's): each prompt token's logprob and this many alternatives (0..20),
    # answered as the response's `prompt_logprobs`; not with stream (as in vLLM).
    prompt_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    # Default: "auto" with tools, "none" without.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class PromptTokensDetails(BaseModel):
    """`usage.prompt_tokens_details`."""

    # Prompt tokens served from a worker's prefix cache (not computed again).
    cached_tokens: int


class Usage(BaseModel):
    """Token counts of one request (summed over its choices and prompts)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """A completion choice's `logprobs`: one entry per token of the choice's text (the
    echoed prompt's first token has none)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    # Per token: the `logprobs` most likely tokens (and the chosen one), text -> logprob.
    top_logprobs: list[dict[str, float] | None]
    # Per token: where its text starts in the choice's text.
    text_offset: list[int]


class ChatTopLogprob(BaseModel):
    """One alternative at a position of a chat choice."""

    token: str
    logprob: float
    # The token's text as UTF-8 bytes (a token may hold part of a character).
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    """One output token of a chat choice with its alternatives."""

    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's `logprobs`."""

    content: list[ChatTokenLogprob] | None


class PromptLogprob(BaseModel):
    """One token at one prompt position, as vLLM's `Logprob`."""

    logprob: float
    # 1 = most likely; None for the prompt's own token when it is not among the alternatives
    # (the worker reports the top alternatives, not every token's rank).
    rank: int | None
    decoded_token: str


class CompletionChoice(BaseModel):
    """A choice of a completion, whole or as a streamed chunk."""

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # Only with `return_token_ids`: the tokens this choice (or chunk) adds.
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)
    # Only with `return_token_ids` (as vLLM): the choice's prompt, whole or on its first chunk.
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)
    # With `prompt_logprobs` (whole answers only): as ChatCompletionResponse's, per choice.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        default=None, exclude_if=lambda v: v is None
    )


class _Answer(BaseModel):
    """What every completion, chat completion and chunk starts with."""

    id: str
    # Each answer narrows this to its own literal (the field keeps its place, second).
    object: str
    created: int
    model: str


class CompletionResponse(_Answer):
    """A completion, or (object unchanged, as OpenAI does) one chunk of a streamed one."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class FunctionCallOut(BaseModel):
    """A call's function in an answer."""

    name: str
    arguments: str


class ToolCallOut(BaseModel):
    """One tool call of a whole chat completion."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    """The answer's message of a whole chat completion (content None when it only calls)."""

    # "assistant", or with add_generation_prompt false the final message's role (as vLLM).
    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = Field(default=None, exclude_if=lambda v: v is None)


class FunctionDeltaOut(BaseModel):
    """A piece of a call's function: the whole name on its first piece, then arguments."""

    name: str | None = Field(default=None, exclude_if=lambda v: v is None)
    arguments: str


class ToolCallDeltaOut(BaseModel):
    """A piece of tool call `index`; its first carries the id and type, as OpenAI streams."""

    index: int
    id: str | None = Field(default=None, exclude_if=lambda v: v is None)
    type: Literal["function"] | None = Field(default=None, exclude_if=lambda v: v is None)
    function: FunctionDeltaOut


class _ChatChoiceFields(BaseModel):
    """What a chat choice carries, whole or streamed, besides its message or delta."""

    index: int = 0
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    # Only with `return_token_ids`: the tokens this choice (or chunk) adds.
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatChoice(_ChatChoiceFields):
    """A choice of a whole chat completion."""

    message: ChatMessageOut


class ChatCompletionResponse(_Answer):
    """A whole chat completion."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    # Only with `return_token_ids` (as vLLM): the prompt the chat template made.
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)
    # With `prompt_logprobs`: per prompt position (the first: None, nothing predicts it) the
    # prompt's token and the alternatives, keyed by token id.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        default=None, exclude_if=lambda v: v is None
    )


class ChatDelta(BaseModel):
    """What a chat chunk adds: the role on the first chunk, then content and calls."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatChunkChoice(_ChatChoiceFields):
    """A choice of one streamed chat chunk."""

    delta: ChatDelta


class ChatCompletionChunk(_Answer):
    """One streamed chat chunk; the usage chunk has no choices."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    # Only with `return_token_ids`, on the stream's first chunk (as vLLM): the prompt.
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=lambda v: v is None)


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
