"""argparse types for flag values, each naming the bad value it refuses.

Config dataclasses name them in their declarations (`setting(1, type=positive_int)`), so the
command line, the environment and a `--config` file check a value the same way. Light on
purpose (argparse only): config modules import it.
"""

from __future__ import annotations

import argparse


def _int_in(text: str, low: int, high: int | None, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_in(text, 1, None, "a positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_in(text, 0, None, "an integer >= 0")


def port(text: str) -> int:
    """argparse type: a TCP port, 0 (the kernel picks) to 65535."""
    return _int_in(text, 0, 65535, "a port 0..65535")


def _float_in(text: str, low: float, strict: bool, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not value < float("inf") or value < low or (strict and value == low):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _float_in(text, 0.0, True, "a number > 0")


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    return _float_in(text, 0.0, False, "a number >= 0")
