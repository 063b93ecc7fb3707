"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked. Pure.

Every refusal is a 400 naming the field: a name OpenAI would not take or given twice,
parameters that are not a JSON-schema object or that the grammar library cannot compile (each
tool's schema is compiled, whatever the choice, so a tool that could never be forced is refused
up front), a `tool_choice` that needs tools when there are none, or names a tool not listed.
`required` and a named choice become a grammar in the router's call format (`tools.formats`);
`auto` with a JSON structured output, a grammar of calls or that JSON (so an agent with a
typed final answer can still call tools), as OpenAI serves the two together.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence

from pdserve.engine.grammar import GrammarCompiler
from pdserve.errors import GrammarError, GrammarUnavailable, InvalidRequest
from pdserve.protocol.sampling import GrammarKind, GrammarSpec
from pdserve.router.api.openai_models import ChatCompletionRequest, NamedToolChoice, ToolDefinition
from pdserve.tools.formats import ToolFormat
from pdserve.tools.spec import NAME_PATTERN, ChoiceKind, FunctionTool, ToolChoice, ToolRequest

# Grammars already compiled: agents send the same tools every turn.
_CACHE_SIZE = 256


def tool_request(body: ChatCompletionRequest) -> ToolRequest | None:
    """The request's tools and how they may be used; None when none may be called."""
    tools = function_tools(body.tools or [])
    choice = _choice(body.tool_choice, {t.name for t in tools})
    if not tools:
        return None
    parallel = body.parallel_tool_calls and choice.kind is not ChoiceKind.NAMED
    return ToolRequest(tools, choice, parallel)


def function_tools(entries: Sequence[ToolDefinition]) -> tuple[FunctionTool, ...]:
    """`tools` checked: names OpenAI takes, each once, parameters a JSON-schema object."""
    tools: list[FunctionTool] = []
    for i, entry in enumerate(entries):
        function = entry.function
        where = f"tools[{i}].function"
        if not NAME_PATTERN.fullmatch(function.name):
            raise InvalidRequest(
                f"{where}.name: must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got"
                f" {function.name[:80]!r}",
                "tools",
            )
        if any(t.name == function.name for t in tools):
            raise InvalidRequest(f"{where}.name: {function.name!r} is listed twice", "tools")
        parameters = function.parameters or {"type": "object", "properties": {}}
        if parameters.get("type", "object") != "object":
            raise InvalidRequest(
                f"{where}.parameters: must be a JSON schema of type object", "tools"
            )
        tools.append(FunctionTool(function.name, function.description, parameters))
    return tuple(tools)


def _choice(raw: str | NamedToolChoice | None, names: set[str]) -> ToolChoice:
    if raw is None:
        return ToolChoice(ChoiceKind.AUTO if names else ChoiceKind.NONE)
    if isinstance(raw, NamedToolChoice):
        if raw.function.name not in names:
            listed = ", ".join(sorted(names)) or "none"
            raise InvalidRequest(
                f"tool_choice: names function {raw.function.name!r}, which is not in tools"
                f" (listed: {listed})",
                "tool_choice",
            )
        return ToolChoice(ChoiceKind.NAMED, raw.function.name)
    kind = ChoiceKind(raw)
    if kind is not ChoiceKind.NONE and not names:
        raise InvalidRequest(f"tool_choice: {raw!r} needs tools, and none are given", "tool_choice")
    return ToolChoice(kind)


class ToolGrammars:
    """Compiles tool grammars for one tokenizer, once each."""

    def __init__(self, compiler: GrammarCompiler, fmt: ToolFormat) -> None:
        self._compiler = compiler
        self.format = fmt
        self._checked: OrderedDict[str, None] = OrderedDict()

    def check(self, tools: ToolRequest, answer: GrammarSpec | None) -> GrammarSpec | None:
        """The grammar of a request with `tools` whose text answer must follow `answer` (its
        structured output, or None). Each tool's schema is compiled (InvalidRequest naming
        the first that fails). A forced choice is a grammar of calls (the text answer never
        comes); `auto` with a JSON answer, calls or that JSON; otherwise the answer's own."""
        for i, tool in enumerate(tools.tools):
            spec = GrammarSpec(GrammarKind.GRAMMAR, self.format.grammar([tool], parallel=False))
            self._compile(spec, f"tools[{i}].function.parameters", "tools")
        if tools.choice.forced:
            text = self.format.grammar(tools.callable_tools(), tools.parallel)
        elif tools.choice.kind is ChoiceKind.AUTO and answer is not None:
            if answer.kind is not GrammarKind.JSON_SCHEMA:
                raise InvalidRequest(
                    "tool_choice: auto combines with a JSON response_format or guided_json"
                    f" only, not {answer.kind.value}",
                    "tool_choice",
                )
            text = self.format.grammar(tools.tools, tools.parallel, json.loads(answer.source))
        else:
            return answer
        spec = GrammarSpec(GrammarKind.GRAMMAR, text)
        self._compile(spec, "tool_choice", "tool_choice")
        return spec

    def _compile(self, spec: GrammarSpec, where: str, param: str) -> None:
        if spec.source in self._checked:
            self._checked.move_to_end(spec.source)
            return
        try:
            self._compiler.check(spec)
        except (GrammarError, GrammarUnavailable) as exc:
            raise InvalidRequest(f"{where}: {exc}", param, "invalid_grammar") from exc
        self._checked[spec.source] = None
        if len(self._checked) > _CACHE_SIZE:
            self._checked.popitem(last=False)
