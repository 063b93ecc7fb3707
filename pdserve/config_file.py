"""`--config FILE`: a YAML or JSON mapping of flag names to values, for any pdserve command.

The file holds the same settings as the command line, keyed by flag name without the dashes
(`max-num-seqs` or `max_num_seqs`). Each value is checked against the flag it names, with the
flag's own type and choices, before anything starts: an unknown key (with the closest flag,
if one is close), a value of the wrong type or outside the choices is a `ConfigError` naming
the file and the key. The values become the parser's defaults (`settings.parse_args`), so the
environment and the command line override them (repeatable flags such as `--worker` add to
the file's list). Booleans: `true` or `false`, for `--X/--no-X` pairs and plain flags alike.

YAML needs PyYAML (a dependency of pdserve); a `.json` file is read with the standard library.
"""

from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.errors import ConfigError

FLAG = "--config"


def load_mapping(path: Path) -> dict[str, Any]:
    """The file's top-level mapping (JSON by extension, YAML otherwise)."""
    try:
        text = path.read_text("utf-8")
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc}") from exc
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # json and yaml each raise their own error types
        kind = "JSON" if path.suffix.lower() == ".json" else "YAML"
        raise ConfigError(f"config {path}: not valid {kind}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: must be a mapping of flag names to values")
    return data


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    by_flag: dict[str, argparse.Action] = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--"):
                by_flag[option[2:]] = action
    return by_flag


def file_defaults(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """The values of the file at `path`, by the parser's destination; ConfigError naming the
    file and the bad key."""
    actions = _actions(parser)
    source = str(path)
    values: dict[str, Any] = {}
    for raw_key, value in load_mapping(path).items():
        key = str(raw_key).replace("_", "-")
        action = actions.get(key)
        if action is None or key in ("config", "help", "ready-file"):
            close = difflib.get_close_matches(key, [k for k in actions if not k.startswith("no-")])
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"config {source}: unknown key {raw_key!r}{hint}")
        if isinstance(action, argparse.BooleanOptionalAction) and key.startswith("no-"):
            raise ConfigError(f"config {source}: key {raw_key!r}: write {key[3:]}: false instead")
        values[action.dest] = _value(action, value, f"config {source}: key {raw_key!r}")
    return values


def _value(action: argparse.Action, value: Any, where: str) -> Any:
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return value
        return action.const if value else action.default  # store_true / store_const
    repeat = isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*")
    values = value if isinstance(value, list) else [value]
    if not repeat and isinstance(value, list):
        raise ConfigError(f"{where}: expected one value, got a list")
    if not values and action.nargs == "+":
        raise ConfigError(f"{where}: expected at least one value")
    checked = [checked_value(action, v, where) for v in values]
    return checked if repeat else checked[0]


def checked_value(action: argparse.Action, value: Any, where: str) -> Any:
    """`value` converted by the option's type and checked against its choices, as argparse
    would on the command line; ConfigError naming `where` otherwise."""
    if isinstance(value, (dict, list)) or value is None:
        raise ConfigError(f"{where}: expected a single value, got {value!r}")
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a value for {action.dest}, got {value!r}")
    text = str(value)
    convert = action.type if callable(action.type) else str
    try:
        converted = convert(text)
    except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc or 'bad value'} (got {value!r})") from None
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(str(c) for c in action.choices)
        raise ConfigError(f"{where}: {value!r} is not one of {choices}")
    return converted


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """Declare `--config FILE` on `parser` (read by `expand`)."""
    parser.add_argument(
        FLAG,
        type=Path,
        default=None,
        metavar="FILE",
        help="YAML or JSON file of flag values; flags on the command line override it",
    )


def split_config_flag(argv: Sequence[str]) -> tuple[list[str], str | None]:
    """`argv` without its `--config FILE`, and the file named (None: none)."""
    argv = list(argv)
    paths: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == FLAG and i + 1 < len(argv):
            paths.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith(FLAG + "="):
            paths.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    if len(paths) > 1:
        raise ConfigError(f"config: give {FLAG} once, got {len(paths)}")
    return rest, paths[0] if paths else None
