"""The Responses API request body, strict as the chat bodies are: unknown fields are refused,
and fields pdserve does not serve are refused by name when set to anything that matters."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from pdserve.router.api.openai_models import FunctionDefinition, JsonSchemaFormat


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputText(_Strict):
    """A text content part (`input_text` from the user, `output_text` from the assistant)."""

    type: Literal["input_text", "output_text"]
    text: str
    # Sent back by clients on assistant text; nothing to render.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class _Item(_Strict):
    """What every input item may carry."""

    # Set on items a client sends back from an earlier response; nothing to render.
    id: str | None = None
    status: str | None = None


class MessageItem(_Item):
    """A message of the conversation."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    # Sent back on assistant messages too; nothing to render.
    phase: str | None = None


class FunctionCallItem(_Item):
    """A function call the model made earlier (sent back with its result)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    """The result of a function call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(FunctionDefinition):
    """A function tool (the Responses form: the chat definition's fields at the top level)."""

    type: Literal["function"]


class NamedFunction(_Strict):
    """`tool_choice` naming the one function to call."""

    type: Literal["function"]
    name: str


class TextFormat(JsonSchemaFormat):
    """`text.format`: plain text, any JSON object, or JSON matching a schema (the chat
    `json_schema` fields at the top level)."""

    type: Literal["text", "json_object", "json_schema"]


class TextConfig(_Strict):
    """`text`."""

    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class ResponsesRequest(_Strict):
    """POST /v1/responses."""

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    # Keep the response for `previous_response_id` (only with the router's --enable-store).
    store: bool | None = None
    previous_response_id: str | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Extension (vLLM): seeds the sampling, for a reproducible sampled response.
    seed: int | None = None
    # Served only at the values that change nothing (`translate` refuses the others by name).
    truncation: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    service_tier: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    prompt_cache_key: str | None = None
