"""argparse types for flag values, each naming the bad value it refuses.

Config dataclasses name them in their declarations (`setting(1, type=positive_int)`), so the
command line, the environment and a `--config` file check a value the same way. Light on
purpose (argparse only): config modules import it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _number_in(text: str, convert: Callable[[str], T], ok: Callable[[T], bool], what: str) -> T:
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _number_in(text, int, lambda v: v >= 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _number_in(text, int, lambda v: v >= 0, "an integer >= 0")


def port(text: str) -> int:
    """argparse type: a TCP port, 0 (the kernel picks) to 65535."""
    return _number_in(text, int, lambda v: 0 <= v <= 65535, "a port 0..65535")


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _number_in(text, float, lambda v: 0 < v < math.inf, "a number > 0")


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    return _number_in(text, float, lambda v: 0 <= v < math.inf, "a number >= 0")
