"""Configuration declared once: a config field carries its flag, and every source reads it.

A field of a config dataclass declares its command-line flag where it is declared
(`max_queued: int = setting(64, help=...)`, the flag's options in its metadata); `add_fields`
turns the fields of a dataclass
into argparse options and `build` turns the parsed values back into the dataclass, so a
setting is written once, beside its default and its validation. Where a flag's unit differs
from the field's (`--slo-ttft-ms` for `ttft_s`), the declaration says how to convert.

`parse_args` reads every source a command takes, for any parser and its subcommands, in this
order of precedence: the command line, then the environment (`PDSERVE_<FLAG>`, e.g.
`PDSERVE_MAX_NUM_SEQS=32` for `--max-num-seqs`), then a `--config FILE` (YAML or JSON, keys
are flag names), then the default. Values from the environment and the file are checked with
the flag's own type and choices before anything starts; a bad one is a `ConfigError` naming
the variable or the key (text flags with a `check` are checked, naming the flag, when their
config is built).

Why not a library: tyro (1.0.17) and pydantic-settings (2.16.3) both install here and were
tried on a nested config. Both name a nested field's flag with a dot (`--breaker.window`), which
would rename every flag users have; keeping today's names (`--no-breaker`, `--slo-ttft-ms` for
a field in seconds) would need a per-field annotation in either, as many lines as this table;
and a bad value comes back as a multi-line report (tyro's boxed panel, pydantic's
ValidationError) where pdserve answers with one line naming the flag and the source. A table
read by argparse keeps every flag as it is, and is small.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pdserve.config_file import checked_value, file_defaults, split_config_flag
from pdserve.errors import ConfigError

ENV_PREFIX = "PDSERVE_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """How one config field appears on the command line."""

    help: str | None = None
    # The flag without its dashes; None: the prefix given to `add_fields` + the field's name.
    name: str | None = None
    # argparse's type for the flag's text; None: the field default's own type.
    type: Callable[[str], Any] | None = None
    choices: Sequence[Any] | None = None
    # The field's value from the flag's (units, parsing); None: the same value.
    to_field: Callable[[Any], Any] | None = None
    # Like `to_field`, and given the flag (`--rates`) to name in the ConfigError of a bad
    # value: for text flags checked when the config is built rather than by argparse (the
    # benchmarks' comma lists and ranges).
    check: Callable[[str, Any], Any] | None = None
    # The flag's default from the field's default; None: the same value.
    to_flag: Callable[[Any], Any] | None = None
    # A store_true flag that turns the (default True) field off: `--no-breaker`.
    turns_off: bool = False
    nargs: str | None = None
    metavar: str | None = None
    # argparse's action where the type's own does not fit: "append" (a repeatable flag whose
    # values make a tuple), "store_true" (a plain switch, no `--no-` form).
    action: str | None = None
    # The argument group it is listed under in --help (None: the container given).
    group: str | None = None


def flag(**options: Any) -> dict[str, Flag]:
    """Field metadata declaring the field's flag (the keywords of `Flag`)."""
    return {"flag": Flag(**options)}


def setting(default: Any, like: Flag | None = None, **options: Any) -> Any:
    """A config dataclass field with default `default` that declares its flag (the keywords of
    `Flag`): `max_queued: int = setting(64, help="...")`. `like`: a flag several configs share
    (`config.MODEL`), declared once; `options` change it for this field."""
    spec = dataclasses.replace(like, **options) if like is not None else Flag(**options)
    return dataclasses.field(default=default, metadata={"flag": spec})


def repeated(name: str, **options: Any) -> Any:
    """A tuple field, empty by default, declaring the repeatable flag `--name` whose values
    make the tuple (the keywords of `Flag` besides)."""
    return setting((), name=name, action="append", to_field=tuple, **options)


def _flag_of(f: dataclasses.Field[Any]) -> Flag | None:
    found = f.metadata.get("flag")
    return found if isinstance(found, Flag) else None


def _option(f: dataclasses.Field[Any], spec: Flag, prefix: str) -> str:
    return spec.name if spec.name is not None else prefix + f.name.replace("_", "-")


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def group_titled(
    group: argparse._ActionsContainer, title: str | None
) -> argparse._ActionsContainer:
    """The argument group titled `title` of `group`'s parser (made on first use; `group`
    itself when it is a group already or `title` is None)."""
    if title is None or not isinstance(group, argparse.ArgumentParser):
        return group
    for existing in group._action_groups:
        if existing.title == title:
            return existing
    return group.add_argument_group(title)


def add_fields(
    group: argparse._ActionsContainer,
    cls: type[Any],
    prefix: str = "",
    skip: Sequence[str] = (),
    groups: Sequence[str | None] | None = None,
    only: Sequence[str] | None = None,
) -> None:
    """An option for every field of `cls` that declares a flag (fields named in `skip` left
    out: another command declares them; with `groups`, only fields listed in one of those
    --help groups, None standing for no group; with `only`, the fields it names, in its
    order)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for f in fields.values() if only is None else [fields[name] for name in only]:
        spec = _flag_of(f)
        if spec is None or f.name in skip or (groups is not None and spec.group not in groups):
            continue
        name = f"--{_option(f, spec, prefix)}"
        where = group_titled(group, spec.group)
        if spec.turns_off or spec.action == "store_true":
            where.add_argument(name, action="store_true", help=spec.help)
            continue
        default = _default(f)
        shown = spec.to_flag(default) if spec.to_flag is not None else default
        if isinstance(default, bool) and spec.type is None:
            where.add_argument(
                name, action=argparse.BooleanOptionalAction, default=shown, help=spec.help
            )
            continue
        options: dict[str, Any] = {"default": shown, "help": spec.help}
        if spec.action == "append":
            options.update(action="append", default=list(shown or ()), choices=spec.choices)
            options.update(type=spec.type)
        else:
            options.update(type=spec.type or (type(shown) if shown is not None else str))
            options.update(choices=spec.choices, nargs=spec.nargs)
        if spec.metavar is not None:
            options["metavar"] = spec.metavar
        where.add_argument(name, **options)


T = TypeVar("T")


def build(cls: type[T], args: argparse.Namespace, prefix: str = "", **given: Any) -> T:
    """`cls` from the parsed flags of its declared fields, plus `given` fields (which win)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        spec = _flag_of(f)
        if spec is None or f.name in given:
            continue
        dest = _option(f, spec, prefix).replace("-", "_")
        if not hasattr(args, dest):
            continue  # declared, but not on this command (`skip` in `add_fields`)
        value = getattr(args, dest)
        if spec.turns_off:
            values[f.name] = not value
        elif spec.check is not None:
            values[f.name] = spec.check(f"--{_option(f, spec, prefix)}", value)
        else:
            values[f.name] = spec.to_field(value) if spec.to_field is not None else value
    return cls(**values, **given)


# ---- sources: command line > environment > config file > default ---------------------------


def env_name(action: argparse.Action) -> str:
    """The environment variable of an option: `--max-num-seqs` -> PDSERVE_MAX_NUM_SEQS."""
    return ENV_PREFIX + action.dest.upper()


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    skip = {"help", "config", "ready_file"}
    return [a for a in parser._actions if a.option_strings and a.dest not in skip]


def _from_text(action: argparse.Action, text: str, where: str) -> Any:
    """An environment variable's text as the option's value, checked as the flag would be."""
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        lowered = text.strip().lower()
        if lowered in _TRUE:
            return True if action.const is None else action.const
        if lowered in _FALSE:
            return False if isinstance(action, argparse.BooleanOptionalAction) else action.default
        raise ConfigError(f"{where}: expected one of {', '.join(_TRUE + _FALSE)}, got {text!r}")
    many = isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*")
    parts = [p for p in text.replace(",", " ").split()] if many else [text]
    values = [checked_value(action, p, where) for p in parts]
    return values if many else values[0]


def _env_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for action in _options(parser):
        name = env_name(action)
        if name in environ:
            found[action.dest] = _from_text(action, environ[name], f"environment {name}")
    return found


def _sources(
    parser: argparse.ArgumentParser, argv: Sequence[str], environ: Mapping[str, str]
) -> tuple[list[str], dict[str, Any]]:
    """`argv` without its `--config FILE` (where the parser takes one), and the values the
    file and then the environment set for the parser's options."""
    rest, path = list(argv), None
    if any(a.dest == "config" for a in parser._actions):
        rest, path = split_config_flag(argv)
    preset: dict[str, Any] = {}
    if path is not None:
        preset.update(file_defaults(parser, Path(path)))
    preset.update(_env_defaults(parser, environ))
    return rest, preset


def _subcommand(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> argparse.ArgumentParser | None:
    """The parser of the subcommand `argv` names (`pdserve bench engine`), if any."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = next((arg for arg in argv if arg in action.choices), None)
            return None if chosen is None else action.choices[chosen]
    return None


def parse_args(
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    environ: Mapping[str, str] | None = None,
) -> argparse.Namespace:
    """Parse `argv` over the values the config file (`--config FILE` in `argv`, where the
    parser takes one) and then the environment set: command line > environment > file >
    default; a subcommand's options likewise. The parser itself is not changed: its defaults
    stay what the code declares (what `pdserve up` compares against to know what to pass on)."""
    environ = os.environ if environ is None else environ
    rest, preset = _sources(parser, argv, environ)
    sub = _subcommand(parser, rest)
    if sub is None:
        return parser.parse_args(rest, namespace=argparse.Namespace(**preset))
    rest, sub_preset = _sources(sub, rest, environ)
    # argparse parses a subcommand into a namespace of its own, whose defaults then overwrite
    # the caller's values: the subcommand's sources become its defaults for this parse only.
    saved = [(a, a.default) for a in sub._actions if a.dest in sub_preset]
    try:
        for action, _ in saved:
            action.default = sub_preset[action.dest]
        return parser.parse_args(rest, namespace=argparse.Namespace(**preset))
    finally:
        for action, default in saved:
            action.default = default
