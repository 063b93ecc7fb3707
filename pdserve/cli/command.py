"""What every command module shares: argument types that name the bad value, the model flags,
and `run`, which turns a command's typed errors into exit statuses.

Exit statuses: 0 done, 2 a bad flag, value or config (one line naming it), otherwise what the
command returns. Light on purpose (argparse only): every command module imports it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from pdserve.config import DEVICES, DTYPES
from pdserve.errors import PdserveError
from pdserve.settings import parse_args


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


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """--model, --dtype, --quantization, --block-size, --device (commands that load an engine)."""
    p.add_argument(
        "--model", default=None, help="Hugging Face model folder (default: tiny built-in)"
    )
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="float16: CUDA only")
    p.add_argument("--quantization", default=None, choices=["int8"])
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="auto: CUDA when torch has it and a GPU is visible, else the CPU",
    )


def run(
    name: str,
    parser: argparse.ArgumentParser,
    execute: Callable[[argparse.Namespace], int],
    argv: Sequence[str],
    *,
    stop_on_sigterm: bool = False,
) -> int:
    """Parse `argv` with `parser` (over the environment's `PDSERVE_<FLAG>` values and a
    `--config` file where the command takes one) and run `execute`; a typed error exits 2.

    `stop_on_sigterm`: for commands that start local clusters, a SIGTERM raises SystemExit so
    their `finally` blocks stop the children by PID instead of leaving them behind.
    """
    try:
        args = parse_args(parser, argv)
    except PdserveError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    if stop_on_sigterm:
        from pdserve.supervise.process import exit_on_sigterm

        exit_on_sigterm()
    try:
        return execute(args)
    except PdserveError as exc:
        print(f"pdserve {name}: error: {exc}", file=sys.stderr)
        return 2
