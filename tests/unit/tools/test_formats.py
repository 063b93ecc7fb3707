"""Forced tool calls: the grammar of each format compiles, takes exactly the calls it should,
and what it forces is what the parser reads back."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine.grammar import GrammarCompiler
from pdserve.errors import GrammarError
from pdserve.model.tokenizer import Tokenizer
from pdserve.protocol.sampling import GrammarKind, GrammarSpec
from pdserve.tools.formats import FORMATS, ToolFormat
from pdserve.tools.parser import ToolCallParser
from pdserve.tools.spec import FunctionTool

WEATHER = FunctionTool(
    "get_weather",
    "Weather in a city",
    {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "days": {"type": "integer"}},
        "required": ["city"],
        "additionalProperties": False,
    },
)
SEARCH = FunctionTool("search", None, {"type": "object", "properties": {"q": {"type": "string"}}})


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Tokenizer:
    return Tokenizer(tiny_model_path)


def call_text(fmt: ToolFormat, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """Calls as the forced grammar writes them (compact arguments)."""
    return fmt.separator.join(
        f'{fmt.opener}{{"name": {json.dumps(n)}, "{fmt.args_key}": '
        f"{json.dumps(a, separators=(',', ':'))}}}{fmt.closer}"
        for n, a in calls
    )


def accepts(tokenizer: Tokenizer, grammar: str, text: str) -> bool:
    compiler = GrammarCompiler(tokenizer.to_json, tokenizer.vocab_size, tokenizer.eos_token_ids)
    state = compiler.state(GrammarSpec(GrammarKind.GRAMMAR, grammar))
    try:
        for token in tokenizer.encode(text, add_special_tokens=False):
            state.accept(token)
    except GrammarError:
        return False
    return True


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_forced_calls_take_listed_tools_with_valid_arguments_only(
    tokenizer: Tokenizer, fmt: ToolFormat
) -> None:
    one = fmt.grammar([WEATHER, SEARCH], parallel=False)
    both = fmt.grammar([WEATHER, SEARCH], parallel=True)
    named = fmt.grammar([SEARCH], parallel=False)
    weather = ("get_weather", {"city": "Paris", "days": 3})
    search = ("search", {"q": "x"})
    assert accepts(tokenizer, one, call_text(fmt, [weather]))
    assert accepts(tokenizer, one, call_text(fmt, [search]))
    assert not accepts(tokenizer, one, call_text(fmt, [weather, search]))
    assert accepts(tokenizer, both, call_text(fmt, [weather, search]))
    assert not accepts(tokenizer, named, call_text(fmt, [weather]))
    assert not accepts(tokenizer, one, call_text(fmt, [("get_weather", {"city": "Rome"})]))
    assert not accepts(tokenizer, one, call_text(fmt, [("delete_all", {})]))


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_what_a_grammar_forces_the_parser_reads(fmt: ToolFormat) -> None:
    calls = [("get_weather", {"city": "Tokyo"}), ("search", {"q": 'a "quoted" <b>'})]
    ids = (f"call_{i}" for i in itertools.count())
    parser = ToolCallParser(fmt, lambda: next(ids))
    deltas = [parser.feed(ch) for ch in call_text(fmt, calls)] + [parser.finish()]
    assert "".join(d.content for d in deltas) == ""
    names = [c.name for d in deltas for c in d.calls if c.id is not None]
    assert names == ["get_weather", "search"]
    args: dict[int, str] = {}
    for c in (c for d in deltas for c in d.calls):
        args[c.index] = args.get(c.index, "") + c.arguments
    assert [json.loads(args[i]) for i in range(2)] == [a for _, a in calls]


def test_auto_with_a_json_answer_takes_a_call_or_that_json(tokenizer: Tokenizer) -> None:
    fmt = FORMATS["hermes"]
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    grammar = fmt.grammar([WEATHER], parallel=True, answer=answer)
    assert accepts(tokenizer, grammar, call_text(fmt, [("get_weather", {"city": "Paris"})]))
    assert accepts(tokenizer, grammar, '{"ok":true}')
    assert not accepts(tokenizer, grammar, '{"ok":1}')
    assert not accepts(tokenizer, grammar, "plain text")
