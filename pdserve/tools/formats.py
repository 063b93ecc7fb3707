"""The text shape of a tool call in one model family, and the grammar that forces it. Pure.

A format is a row of a table, not a class per family: what opens a call, what closes it, where
calls may stand, and the JSON key of the arguments. Every call's body is one JSON object
`{"name": ..., "<args key>": {...}}`:
- `hermes` (Hermes, Qwen 2.5/3, many others): `<tool_call>\n{...}\n</tool_call>`, anywhere in
  the output, text around the calls allowed;
- `llama3_json` (Llama 3.1/3.2 JSON tool calling): the whole output is `{...}` calls separated
  by `; `, optionally after `<|python_tag|>`; an output that starts otherwise is text.

`required` and a named `tool_choice` are forced with a Lark grammar (llguidance) writing the
same shape with each function's `parameters` schema embedded, so a forced call and a free one
are parsed by the same code, and a weak or random model still produces arguments that validate.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.tools.spec import FunctionTool

# Arguments are compact JSON, as `response_format` is: no free whitespace a weak model could
# emit until max_tokens.
_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How calls look in one model family's output."""

    name: str
    # Text before a call's JSON body ("" for none) and after it.
    opener: str
    closer: str
    # Calls may follow text (True), or only open the output (False: then text is all text).
    anywhere: bool
    # What a forced output writes between two calls (parsing accepts any whitespace, and the
    # separator's non-blank characters).
    separator: str
    # The key holding the arguments in the body (the parser also takes the other usual one).
    args_key: str
    # Tokens that may stand before the first call (Llama's `<|python_tag|>`), skipped.
    preamble: tuple[str, ...] = ()

    def grammar(
        self, tools: Sequence[FunctionTool], parallel: bool, answer: dict[str, Any] | None = None
    ) -> str:
        """A Lark grammar whose outputs are one call (or, with `parallel`, one or more) of
        `tools`, each call's arguments valid under its function's schema; with `answer` (a
        JSON schema), that JSON is the other way to answer."""
        rules = []
        alternatives = []
        for i, tool in enumerate(tools):
            head = f'{{"name": {json.dumps(tool.name)}, "{self.args_key}": '
            rules.append(
                f"call_{i}: {_literal(self.opener + head)} args_{i} {_literal('}' + self.closer)}"
            )
            rules.append(f"args_{i}: %json {json.dumps(_compact(tool.parameters))}")
            alternatives.append(f"call_{i}")
        calls = f"call ({_literal(self.separator)} call)*" if parallel else "call"
        if answer is not None:
            rules.append(f"answer: %json {json.dumps(_compact(answer))}")
            calls += " | answer"
        return "\n".join([f"start: {calls}", "call: " + " | ".join(alternatives), *rules]) + "\n"


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": {**_COMPACT, **schema.get("x-guidance", {})}}


def _literal(text: str) -> str:
    # A Lark string literal: JSON's escapes are Lark's (names are [A-Za-z0-9_-], tags ASCII).
    return json.dumps(text)


HERMES = ToolFormat(
    name="hermes",
    opener="<tool_call>\n",
    closer="\n</tool_call>",
    anywhere=True,
    separator="\n",
    args_key="arguments",
)
LLAMA3_JSON = ToolFormat(
    name="llama3_json",
    opener="",
    closer="",
    anywhere=False,
    separator="; ",
    args_key="parameters",
    preamble=("<|python_tag|>",),
)
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON)}
