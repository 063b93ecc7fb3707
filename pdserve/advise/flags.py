"""Flag values of the benchmark commands, checked before anything starts. Pure.

Each parser takes the flag's name and its text and returns the typed value, or raises
`ConfigError` with one line naming the flag, the accepted range and what was given (the CLI
prints it and exits 2). `None` text (flag not given) passes through as None. A config field
declares such a flag with `checked(default, check)`; `build` then calls the check.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pdserve.errors import ConfigError
from pdserve.settings import Flag, setting

T = TypeVar("T")


def _range_text(low: float, high: float | None, low_open: bool) -> str:
    first = f"> {low:g}" if low_open else f">= {low:g}"
    return first if high is None else f"{first} and <= {high:g}"


def _parse(
    flag: str, text: str, convert: Callable[[str], T], ok: Callable[[T], bool], want: str
) -> T:
    """`convert(text)` if it converts and passes `ok`; else ConfigError naming flag and text."""
    try:
        value = convert(text)
    except ValueError:
        raise ConfigError(f"{flag}: expected {want}, got {text!r}") from None
    if not ok(value):
        raise ConfigError(f"{flag}: expected {want}, got {text!r}")
    return value


def _within(value: float, low: float, high: float | None, low_open: bool) -> bool:
    above = value > low if low_open else value >= low
    return above and (high is None or value <= high)


def _positive(value: float, high: float | None) -> bool:
    return math.isfinite(value) and _within(value, 0, high, True)


def positive_floats(flag: str, text: str, high: float | None = None) -> tuple[float, ...]:
    """Comma-separated numbers, each > 0 (and <= `high`)."""
    return _parse(
        flag,
        text,
        lambda t: tuple(float(part) for part in t.split(",")),
        lambda values: all(_positive(v, high) for v in values),
        f"comma-separated numbers {_range_text(0, high, True)}",
    )


def positive(flag: str, text: str | None, high: float | None = None) -> float | None:
    """A number > 0 (and <= `high`)."""
    if text is None:
        return None
    want = f"a number {_range_text(0, high, True)}"
    return _parse(flag, text, float, lambda v: _positive(v, high), want)


def integer(flag: str, text: str | None, low: int, high: int | None = None) -> int | None:
    """An integer >= `low` (and <= `high`)."""
    if text is None:
        return None
    want = f"an integer {_range_text(low, high, False)}"
    return _parse(flag, text, int, lambda v: _within(v, low, high, False), want)


def integers(flag: str, text: str, low: int) -> tuple[int, ...]:
    """Comma-separated integers, each >= `low`."""
    return _parse(
        flag,
        text,
        lambda t: tuple(int(part) for part in t.split(",")),
        lambda values: bool(values) and min(values) >= low,
        f"comma-separated integers >= {low}",
    )


def one_integer(flag: str, text: str, low: int) -> int:
    """One integer >= `low` (a comma list is refused as such)."""
    values = integers(flag, text, low)
    if len(values) != 1:
        raise ConfigError(f"{flag}: expected one integer >= {low}, got {text!r}")
    return values[0]


def at_least(low: int) -> Callable[[str, str], int]:
    """A `check` for a declared flag: one integer >= `low` (`one_integer`)."""
    return lambda flag, text: one_integer(flag, text, low)


def as_text(value: Any) -> str | None:
    """A field's default as its flag's text: 0.9 -> "0.9", (1.0, 2.0) -> "1,2", None stays."""
    if value is None:
        return None
    if isinstance(value, tuple):
        return ",".join(str(as_text(v)) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def checked(default: Any, check: Callable[[str, str], Any], **options: Any) -> Any:
    """A config field whose flag is text, checked by `check(flag, text)` when the config is
    built (a ConfigError naming the flag, as these commands always answered): the keywords of
    `settings.Flag` besides."""
    return setting(
        default, type=str, to_flag=options.pop("to_flag", as_text), check=check, **options
    )


@dataclass(frozen=True, slots=True)
class LoadFlags:
    """The Poisson load of a benchmark: rates, and requests or seconds per run (one of them)."""

    rates: tuple[float, ...]
    num_requests: int | None
    duration_s: float | None


def add_load_arguments(
    p: argparse.ArgumentParser, rates: Sequence[float], duration_s: float, per: str
) -> None:
    """--rates, --duration-s, --num-requests (checked by `parse_load`); `per` names a run."""
    p.add_argument(
        "--rates",
        default=",".join(f"{r:g}" for r in rates),
        help="comma-separated request rates per second (Poisson arrivals)",
    )
    p.add_argument(
        "--duration-s", default=None, help=f"seconds of arrivals per {per} (default {duration_s:g})"
    )
    p.add_argument(
        "--num-requests", default=None, help=f"requests per {per} (instead of --duration-s)"
    )


def parse_load(
    args: argparse.Namespace,
    default_duration_s: float,
    max_rate: float | None = None,
    max_requests: int | None = None,
    max_duration_s: float | None = None,
) -> LoadFlags:
    """The checked load flags: distinct rates, and --num-requests or --duration-s, not both."""
    rates = positive_floats("--rates", args.rates, max_rate)
    if len(set(rates)) != len(rates):
        raise ConfigError(f"--rates: each rate once, got {args.rates!r}")
    num_requests = integer("--num-requests", args.num_requests, 1, max_requests)
    duration_s = positive("--duration-s", args.duration_s, max_duration_s)
    if num_requests is not None and duration_s is not None:
        raise ConfigError("--num-requests: give it or --duration-s, not both")
    if num_requests is None and duration_s is None:
        duration_s = default_duration_s
    return LoadFlags(rates, num_requests, duration_s)


# Output flags `AdviseConfig` and `ServeConfig` share (their `--model` is `config.MODEL`).
JSON_FILE = Flag(name="json", type=Path, metavar="FILE", help="also write the results here")
PLOT_DIR = Flag(name="plot", type=Path, metavar="DIR")
