"""A chat request's messages through the chat template: the prompt text that
/v1/chat/completions encodes and /tokenize counts, built one way for both."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.errors import InvalidRequest, ModelConfigError
from pdserve.model.tokenizer import Tokenizer
from pdserve.router.api.openai_models import ChatMessage
from pdserve.tools.messages import template_messages
from pdserve.tools.spec import FunctionTool


def render_chat_prompt(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: Sequence[FunctionTool] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> str:
    """The rendered prompt of `messages` (as `message_dicts` makes them; tools as the template
    takes them); a 400 naming the field when the flags contradict each other or the template
    cannot render the messages."""
    if continue_final_message and add_generation_prompt:
        raise InvalidRequest(
            "continue_final_message: cannot be true with add_generation_prompt (set it"
            " false): the final message is either continued or answered",
            "continue_final_message",
        )
    forms = None if tools is None else [t.template_form() for t in tools]
    try:
        return tokenizer.render_chat(
            template_messages(messages), add_generation_prompt, forms, continue_final_message
        )
    except ModelConfigError as exc:
        raise InvalidRequest(f"messages: {exc}", "messages") from exc


def message_dicts(chat: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The chat's messages as plain dicts, text parts joined; other part types refused."""
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(chat):
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if part.type != "text" or part.text is None:
                raise InvalidRequest(
                    f"messages[{i}].content[{j}]: content part type {part.type!r} is not"
                    " supported (text parts only)",
                    "messages",
                )
        if m.tool_calls is not None and m.role != "assistant":
            raise InvalidRequest(
                f"messages[{i}].tool_calls: only assistant messages carry tool calls", "messages"
            )
        if m.tool_call_id is not None and m.role != "tool":
            raise InvalidRequest(
                f"messages[{i}].tool_call_id: only tool messages answer a call", "messages"
            )
        message: dict[str, Any] = {**(m.model_extra or {}), "role": m.role,
                                   "content": m.text() or ""}  # fmt: skip
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return messages
