"""A Responses request as the chat request it runs as. Pure.

`input` items become chat messages: text parts joined, consecutive `function_call` items one
assistant message with those calls, each `function_call_output` a `tool` message (its
`call_id` must answer a call made earlier, here or in the stored conversation).
`instructions` lead as a system message and, as in OpenAI's API, are not carried into a
continued conversation. Tools, `tool_choice`, `text.format` and `max_output_tokens` become
their chat forms; errors the chat builder raises name the Responses field (`PARAMS`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pdserve.errors import InvalidRequest
from pdserve.router.api.responses_api.models import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequest,
)

# Chat field -> the Responses field it came from (for errors the chat builder raises).
PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}

# Fields served only at values that change nothing: (the harmless test, why not otherwise).
_UNSERVED = {
    "truncation": (lambda v: v in (None, "disabled"), "the context is never truncated"),
    "include": (lambda v: not v, "no extra output fields are served"),
    "reasoning": (lambda v: v is None, "the model is not a reasoning model"),
    "background": (lambda v: not v, "responses run in the foreground"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "there is one tier"),
    "top_logprobs": (lambda v: not v, "logprobs are served by /v1/chat/completions"),
    "max_tool_calls": (lambda v: v is None, "the tool-call limit is not implemented"),
}


def chat_body(
    req: ResponsesRequest, history: Sequence[dict[str, Any]]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The chat completion body `req` runs as, after the stored `history`; and the
    conversation it holds (what a stored response keeps: no instructions)."""
    for name, (harmless, why) in _UNSERVED.items():
        value = getattr(req, name)
        if not harmless(value):
            raise InvalidRequest(
                f"{name}: not supported by pdserve ({why}); got {value!r}",
                name,
                "unsupported_parameter",
            )
    messages = conversation(req, history)
    lead = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {
        "model": req.model,
        "messages": lead + messages,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    optional = {"max_completion_tokens": req.max_output_tokens, "seed": req.seed,
                "user": req.user}  # fmt: skip
    body.update({k: v for k, v in optional.items() if v is not None})
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
    if req.tool_choice is not None:
        body["tool_choice"] = (
            req.tool_choice
            if isinstance(req.tool_choice, str)
            else {"type": "function", "function": {"name": req.tool_choice.name}}
        )
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        schema = {"name": fmt.name or "output", "schema": fmt.json_schema}
        body["response_format"] = (
            {"type": "json_schema", "json_schema": schema}
            if fmt.type == "json_schema"
            else {"type": "json_object"}
        )
    return body, messages


def conversation(req: ResponsesRequest, history: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stored `history` and `req.input` as chat messages (no instructions)."""
    messages = [dict(m) for m in history]
    called = {c["id"] for m in messages for c in m.get("tool_calls") or []}
    items = (
        [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    )
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            content = item.content
            text = content if isinstance(content, str) else "\n".join(p.text for p in content)
            messages.append({"role": item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            try:
                json.loads(item.arguments)
            except ValueError as exc:
                raise InvalidRequest(
                    f"input[{i}].arguments: not valid JSON ({exc})", "input"
                ) from None
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            called.add(item.call_id)
        else:
            assert isinstance(item, FunctionCallOutputItem)
            if item.call_id not in called:
                raise InvalidRequest(
                    f"input[{i}].call_id: no function_call before it has call_id {item.call_id!r}",
                    "input",
                )
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def responses_error(exc: InvalidRequest) -> InvalidRequest:
    """`exc` (raised for the chat body) naming the Responses field instead."""
    if exc.param not in PARAMS:
        return exc
    param = PARAMS[exc.param]
    message = exc.message.replace(exc.param, param, 1)
    return InvalidRequest(message, param, exc.code)
