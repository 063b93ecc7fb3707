"""The tool-call parser: what it returns depends on the text only, never on how the text was
cut into pieces; calls come out whole, content never holds part of one."""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.tools.formats import HERMES, LLAMA3_JSON, ToolFormat
from pdserve.tools.parser import ParsedDelta, ToolCallParser

NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,12}", fullmatch=True)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
ARGS = st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=4)
# Content that is no call: anything without the opener's "<tool_call>" and without "{" at
# the start (Llama 3's calls open the output).
CONTENT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30).filter(
    lambda t: "<tool_call>" not in t
)


def run(fmt: ToolFormat, pieces: list[str]) -> tuple[str, list[dict[str, Any]], list[ParsedDelta]]:
    """Feed `pieces`; the content, the calls (id, name, arguments), and every delta."""
    ids = (f"call_{i}" for i in itertools.count())
    parser = ToolCallParser(fmt, lambda: next(ids))
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    calls: list[dict[str, Any]] = []
    for d in deltas:
        for c in d.calls:
            if c.id is not None:
                assert c.index == len(calls) and c.name is not None and c.arguments == ""
                calls.append({"id": c.id, "name": c.name, "arguments": ""})
            else:
                assert c.name is None
                calls[c.index]["arguments"] += c.arguments
    return "".join(d.content for d in deltas), calls, deltas


def cut(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in itertools.pairwise([0, *points, len(text)])]


def hermes_text(content: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    bodies = [
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls
    ]
    return content + ("\n" if calls else "") + "\n".join(bodies)


@settings(max_examples=300, deadline=None)
@given(
    content=CONTENT,
    calls=st.lists(st.tuples(NAMES, ARGS), max_size=3),
    cuts=st.lists(st.integers(0, 400), max_size=12),
)
def test_hermes_calls_and_content_whatever_the_pieces(
    content: str, calls: list[tuple[str, dict[str, Any]]], cuts: list[int]
) -> None:
    text = hermes_text(content, calls)
    whole = run(HERMES, [text])
    pieces = run(HERMES, cut(text, cuts))
    assert pieces[:2] == whole[:2]
    got_content, got_calls, _ = whole
    assert [(c["name"], json.loads(c["arguments"])) for c in got_calls] == calls
    # Blank text around calls is dropped; content is otherwise the model's, untouched.
    assert got_content == (content.rstrip() if calls else content)
    assert "<tool_call>" not in got_content


@settings(max_examples=200, deadline=None)
@given(
    calls=st.lists(st.tuples(NAMES, ARGS), min_size=1, max_size=3),
    python_tag=st.booleans(),
    cuts=st.lists(st.integers(0, 300), max_size=10),
)
def test_llama3_json_calls_whatever_the_pieces(
    calls: list[tuple[str, dict[str, Any]]], python_tag: bool, cuts: list[int]
) -> None:
    text = ("<|python_tag|>" if python_tag else "") + "; ".join(
        json.dumps({"name": n, "parameters": a}) for n, a in calls
    )
    whole = run(LLAMA3_JSON, [text])
    assert run(LLAMA3_JSON, cut(text, cuts))[:2] == whole[:2]
    assert whole[0] == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in whole[1]] == calls


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60), cuts=st.lists(st.integers(0, 60), max_size=8))
def test_text_that_is_no_call_comes_back_whole(text: str, cuts: list[int]) -> None:
    for fmt in (HERMES, LLAMA3_JSON):
        content, calls, _ = run(fmt, cut(text, cuts))
        if not calls:
            assert content == text


def test_a_half_written_opener_is_held_back_until_it_is_not_one() -> None:
    _, _, deltas = run(HERMES, ["The answer <tool", "_ca", "r is 4"])
    assert [d.content for d in deltas] == ["The answer", "", " <tool_car is 4", ""]


def test_the_name_comes_whole_then_the_arguments_in_pieces() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    _, calls, deltas = run(HERMES, list(text))
    heads = [c for d in deltas for c in d.calls if c.id is not None]
    assert [(h.name, h.arguments) for h in heads] == [("get_weather", "")]
    pieces = [c.arguments for d in deltas for c in d.calls if c.id is None]
    assert len(pieces) == len('{"city": "Paris"}') and calls[0]["arguments"] == '{"city": "Paris"}'


def test_keys_in_another_order_are_read_when_the_body_closes() -> None:
    text = '<tool_call>{"arguments": {"q": "x"}, "name": "search"}</tool_call> done'
    content, calls, _ = run(HERMES, list(text))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("search", {"q": "x"})]
    assert content == " done"


def test_a_body_that_is_not_a_call_is_text() -> None:
    text = "<tool_call>\nnot json\n</tool_call> then"
    assert run(HERMES, list(text))[:2] == (text, [])
    assert run(HERMES, ['<tool_call>{"a": 1}</tool_call>'])[:2] == (
        '<tool_call>{"a": 1}</tool_call>',
        [],
    )


def test_a_call_cut_short_keeps_what_was_sent() -> None:
    content, calls, _ = run(HERMES, ['<tool_call>\n{"name": "f", "arguments": {"a": [1, 2'])
    assert content == "" and calls[0]["name"] == "f" and calls[0]["arguments"] == '{"a": [1, 2'


def test_llama3_json_output_that_opens_with_text_is_all_text() -> None:
    text = 'Sure: {"name": "f", "parameters": {}}'
    assert run(LLAMA3_JSON, [text])[:2] == (text, [])
    for text in (' {"a": 1}', '<|python_tag|> {"x": 2} tail', "  {"):
        assert run(LLAMA3_JSON, list(text))[:2] == (text, [])
