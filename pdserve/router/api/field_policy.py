"""Which top-level request fields pdserve serves, ignores on purpose, or refuses. Pure.

Checked on the raw JSON object before validation, so the answer names the field:
- a field the endpoint's model declares is validated by the model;
- an OpenAI field pdserve does not implement is refused (400, `param` = the field) unless its
  value is one that changes nothing (e.g. `functions: []`, `modalities: ["text"]`); then it
  is dropped;
- bookkeeping fields with no effect on the output (`store: false`, `metadata`,
  `service_tier`) are dropped;
- any other field is unknown: 400 naming it, or dropped (and logged) when the router runs with
  `--allow-unknown-fields`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from pdserve.errors import InvalidRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Rule:
    """A field pdserve does not serve: which values are harmless, and why others are not."""

    harmless: Callable[[Any], bool]
    why: str


def _none(value: Any) -> bool:
    return value is None


def _none_or_empty(value: Any) -> bool:
    return value in (None, "", [], {})


def _any(value: Any) -> bool:
    return True


_COMMON: dict[str, _Rule] = {
    # The deprecated forms of `tools` and `tool_choice`.
    "functions": _Rule(_none_or_empty, "use tools, which replaced functions"),
    "function_call": _Rule(lambda v: v in (None, "none"), "use tool_choice"),
    "audio": _Rule(_none, "audio output is not implemented"),
    "modalities": _Rule(lambda v: v in (None, ["text"]), "only text output is implemented"),
    "prediction": _Rule(_none, "predicted outputs are not implemented"),
    "reasoning_effort": _Rule(_none, "the model is not a reasoning model"),
    "web_search_options": _Rule(_none, "web search is not implemented"),
    "store": _Rule(lambda v: v in (None, False), "pdserve stores no completions"),
    "metadata": _Rule(_any, ""),
    "service_tier": _Rule(lambda v: v in (None, "auto", "default"), "there is one tier"),
    "verbosity": _Rule(_none, "verbosity is not implemented"),
    # vLLM extensions pdserve does not serve (README, deliberate differences).
    "use_beam_search": _Rule(
        lambda v: v in (None, False), "beam search is not implemented; n samples independently"
    ),
    "cache_salt": _Rule(
        _none, "prefix-cache isolation is not implemented: every request shares the cache"
    ),
}
_COMPLETION_ONLY: dict[str, _Rule] = {
    "suffix": _Rule(_none_or_empty, "insertion (suffix) is not implemented"),
    "tools": _Rule(_none_or_empty, "tool calling is served by /v1/chat/completions"),
    "tool_choice": _Rule(lambda v: v in (None, "none"), "tool calling is served by chat"),
    "parallel_tool_calls": _Rule(_any, ""),
}
_CHAT_ONLY: dict[str, _Rule] = {}
RULES: dict[str, dict[str, _Rule]] = {
    "completion": {**_COMMON, **_COMPLETION_ONLY},
    "chat": {**_COMMON, **_CHAT_ONLY},
}


def declared_fields(model: type[BaseModel]) -> frozenset[str]:
    """The top-level keys `model` accepts (aliases included)."""
    names = set()
    for name, info in model.model_fields.items():
        names.add(info.alias or name)
    return frozenset(names)


def screen(
    data: Mapping[str, Any], model: type[BaseModel], kind: str, allow_unknown: bool
) -> dict[str, Any]:
    """`data` without the fields that are dropped; InvalidRequest naming a refused one."""
    known = declared_fields(model)
    rules = RULES[kind]
    kept: dict[str, Any] = {}
    for key, value in data.items():
        if key in known:
            kept[key] = value
            continue
        rule = rules.get(key)
        if rule is not None:
            if rule.harmless(value):
                continue
            raise InvalidRequest(
                f"{key}: not supported by pdserve ({rule.why}); got {_short(value)}",
                key,
                "unsupported_parameter",
            )
        if allow_unknown:
            log.warning("ignoring unknown request field %r (--allow-unknown-fields)", key)
            continue
        raise InvalidRequest(
            f"{key}: unknown field (pdserve does not silently ignore fields; the router flag"
            " --allow-unknown-fields drops them)",
            key,
            "unknown_parameter",
        )
    return kept


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
