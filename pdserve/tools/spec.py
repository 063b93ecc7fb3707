"""What a request declares about tools: its function tools and its `tool_choice`. Pure."""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# OpenAI's rule for function names.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """One function the model may call: its name, description and JSON-schema parameters."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object"})

    def template_form(self) -> dict[str, Any]:
        """The tool as chat templates take it (transformers' `tools=` entries)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ChoiceKind(enum.Enum):
    """`tool_choice`: what the model may or must do with the tools."""

    NONE = "none"  # answer in text; nothing is parsed as a call
    AUTO = "auto"  # text or calls, as the model decides; calls are parsed out
    REQUIRED = "required"  # at least one call of a listed tool (grammar-forced)
    NAMED = "named"  # exactly one call of the named tool (grammar-forced)


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """A resolved `tool_choice` (`name` only for NAMED)."""

    kind: ChoiceKind
    name: str | None = None

    @property
    def forced(self) -> bool:
        """True when a grammar makes the output a call."""
        return self.kind in (ChoiceKind.REQUIRED, ChoiceKind.NAMED)


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """The tools of one chat request and how they may be used."""

    tools: tuple[FunctionTool, ...]
    choice: ToolChoice
    parallel: bool = True

    def callable_tools(self) -> Sequence[FunctionTool]:
        """The tools a forced call may use: the named one, or all."""
        if self.choice.kind is ChoiceKind.NAMED:
            return [t for t in self.tools if t.name == self.choice.name]
        return self.tools

    @property
    def parsed(self) -> bool:
        """True when the output is read for calls (any choice but `none`)."""
        return self.choice.kind is not ChoiceKind.NONE
