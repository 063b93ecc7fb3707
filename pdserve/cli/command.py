"""What every command module shares: the model flags, and `run`, which turns a command's typed
errors into exit statuses.

Exit statuses: 0 done, 2 a bad flag, value or config (one line naming it), otherwise what the
command returns. Light on purpose (argparse only): every command module imports it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from pdserve.config import EngineConfig, ModelLoadConfig
from pdserve.errors import PdserveError
from pdserve.settings import add_fields, build, parse_args


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """--model, --dtype, --quantization, --block-size, --device (commands that load an engine),
    from `ModelLoadConfig`'s and `EngineConfig`'s declarations; `model_config` reads them."""
    add_fields(p, ModelLoadConfig, skip=("device",))
    add_fields(p, EngineConfig, only=("block_size",))
    add_fields(p, ModelLoadConfig, only=("device",))


def model_config(args: argparse.Namespace) -> ModelLoadConfig:
    """The model to load, from the flags `add_model_flags` declared."""
    return build(ModelLoadConfig, args)


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
