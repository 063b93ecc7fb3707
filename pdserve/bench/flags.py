"""Flag values of the benchmark commands, checked before anything starts. Pure.

Each parser takes the flag's name and its text and returns the typed value, or raises
`ConfigError` with one line naming the flag, the accepted range and what was given (the CLI
prints it and exits 2). `None` text (flag not given) passes through as None.
"""

from __future__ import annotations

import math

from pdserve.errors import ConfigError


def _range_text(low: float, high: float | None, low_open: bool) -> str:
    first = f"> {low:g}" if low_open else f">= {low:g}"
    return first if high is None else f"{first} and <= {high:g}"


def positive_floats(flag: str, text: str, high: float | None = None) -> tuple[float, ...]:
    """Comma-separated numbers, each > 0 (and <= `high`)."""
    want = f"comma-separated numbers {_range_text(0, high, True)}"
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag}: expected {want}, got {text!r}") from None
    if not all(math.isfinite(v) and v > 0 and (high is None or v <= high) for v in values):
        raise ConfigError(f"{flag}: expected {want}, got {text!r}")
    return values


def positive(flag: str, text: str | None, high: float | None = None) -> float | None:
    """A number > 0 (and <= `high`)."""
    if text is None:
        return None
    want = f"a number {_range_text(0, high, True)}"
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{flag}: expected {want}, got {text!r}") from None
    if not (math.isfinite(value) and value > 0 and (high is None or value <= high)):
        raise ConfigError(f"{flag}: expected {want}, got {text!r}")
    return value


def integer(flag: str, text: str | None, low: int, high: int | None = None) -> int | None:
    """An integer >= `low` (and <= `high`)."""
    if text is None:
        return None
    want = f"an integer {_range_text(low, high, False)}"
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{flag}: expected {want}, got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise ConfigError(f"{flag}: expected {want}, got {text!r}")
    return value
