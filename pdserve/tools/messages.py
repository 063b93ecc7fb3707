"""OpenAI chat messages with tool calls and tool results, as chat templates take them. Pure.

Templates (Hermes, Qwen, Llama 3.1 and transformers' convention) render an assistant call's
arguments with `tojson`, so they need the arguments as an object, while OpenAI sends them as a
JSON string: they are parsed here, as vLLM does. A `tool` message must answer a call an earlier
assistant message made (its `tool_call_id`); one that answers nothing is refused, since the
template would render a result with no question.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.errors import InvalidRequest


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`messages` (dicts in OpenAI's shape) ready for a template; InvalidRequest naming the
    message and field that is wrong."""
    out: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        entry = dict(message)
        calls = message.get("tool_calls")
        if calls:
            entry["tool_calls"] = [_call(i, j, call) for j, call in enumerate(calls)]
            call_ids.update(call["id"] for call in calls)
        if message.get("role") == "tool":
            call_id = message.get("tool_call_id")
            if call_id is None:
                raise InvalidRequest(
                    f"messages[{i}].tool_call_id: a tool message needs the id of the call it"
                    " answers",
                    "messages",
                )
            if call_id not in call_ids:
                raise InvalidRequest(
                    f"messages[{i}].tool_call_id: no earlier assistant message made a call with"
                    f" id {call_id!r}",
                    "messages",
                )
        out.append(entry)
    return out


def _call(i: int, j: int, call: Mapping[str, Any]) -> dict[str, Any]:
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"])
    except ValueError as exc:
        raise InvalidRequest(
            f"messages[{i}].tool_calls[{j}].function.arguments: not valid JSON ({exc})",
            "messages",
        ) from None
    return {**call, "function": {**function, "arguments": arguments}}
