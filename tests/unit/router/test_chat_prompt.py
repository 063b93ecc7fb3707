"""The chat prompt /v1/chat/completions encodes and /tokenize counts (`router/api/chat_prompt`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pdserve.errors import InvalidRequest
from pdserve.model.tokenizer import Tokenizer
from pdserve.router.api.chat_prompt import message_dicts, render_chat_prompt
from pdserve.router.api.openai_models import ChatMessage
from pdserve.tools.spec import FunctionTool

CHAT = [ChatMessage(role="user", content="Tell me a story"),
        ChatMessage(role="assistant", content="Once upon a")]  # fmt: skip


def test_the_prompt_is_the_templates_text_and_continues_the_final_message(
    tiny_model_path: Path,
) -> None:
    tok = Tokenizer(tiny_model_path)
    answered = render_chat_prompt(tok, message_dicts(CHAT), None, True, False)
    continued = render_chat_prompt(tok, message_dicts(CHAT), None, False, True)
    assert answered == tok.render_chat(message_dicts(CHAT), True)
    assert continued.endswith("<|assistant|>\nOnce upon a")
    assert answered.startswith(continued) and answered != continued


def test_tools_reach_the_template_in_its_form(tiny_model_path: Path) -> None:
    tok = Tokenizer(tiny_model_path)
    tool = FunctionTool(name="get_weather", description="the weather", parameters={})
    with_tools = render_chat_prompt(tok, message_dicts(CHAT[:1]), (tool,), True, False)
    assert "get_weather" in with_tools
    assert with_tools == tok.render_chat(message_dicts(CHAT[:1]), True, [tool.template_form()])


def test_contradicting_flags_are_a_400_naming_continue_final_message(
    tiny_model_path: Path,
) -> None:
    with pytest.raises(InvalidRequest, match="either continued or answered") as info:
        render_chat_prompt(Tokenizer(tiny_model_path), message_dicts(CHAT), None, True, True)
    assert info.value.param == "continue_final_message"


def test_a_template_that_cannot_render_is_a_400_naming_messages(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    config = folder / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["chat_template"] = "{{ raise_exception('only user turns, please') }}"
    config.write_text(json.dumps(data))
    with pytest.raises(InvalidRequest, match="only user turns") as info:
        render_chat_prompt(Tokenizer(folder), message_dicts(CHAT), None, True, False)
    assert info.value.param == "messages"


def with_template(tiny_model_path: Path, tmp_path: Path, template: str) -> Path:
    """A copy of the tiny model whose chat template is `template`."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    config = folder / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["chat_template"] = template
    config.write_text(json.dumps(data))
    return folder


# As Llama 3.1's template: tool instructions whenever `tools` is given, an empty list too.
TOOLS_NOT_NONE = (
    "{% if tools is defined and tools is not none %}TOOLS{{ tools | length }}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
)


def test_no_tools_reach_the_template_as_none_however_given(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """An empty tools list renders as no tools at all (the tokenizer leaves `tools` out), so
    /tokenize (which always passes a list) and a chat without tools give one prompt."""
    tok = Tokenizer(with_template(tiny_model_path, tmp_path, TOOLS_NOT_NONE))
    none = render_chat_prompt(tok, message_dicts(CHAT), None, False, False)
    empty = render_chat_prompt(tok, message_dicts(CHAT), (), False, False)
    assert none == empty == "user: Tell me a story\nassistant: Once upon a\n"
    tool = FunctionTool(name="get_weather", description="the weather", parameters={})
    assert render_chat_prompt(tok, message_dicts(CHAT), (tool,), False, False).startswith("TOOLS1")
