"""What `pdserve bench engine` measures, its flags declared on the fields (`pdserve.settings`).

Light on purpose (no torch): the bench parser imports it; `bench/engine.py` runs it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from pdserve.cli.command import model_config
from pdserve.config import ModelLoadConfig
from pdserve.flag_types import positive_int
from pdserve.settings import build, repeated, setting

# `--model-shape` choices: "tiny" and `model_shapes.SHAPES`, spelled out here so the parser
# builds without importing torch; a unit test keeps them equal.
MODEL_SHAPES = ("tiny", "smollm-135m", "llama-3.2-1b")
# What runs when no --model-shape is given (the 1B shape is for GPUs: `gpu-check`).
DEFAULT_SHAPES = ("tiny", "smollm-135m")


@dataclass(frozen=True, slots=True)
class EngineBenchConfig:
    """The checkpoints, cases and repeats of one engine benchmark."""

    # From the engine's own flags (--model, --dtype, --quantization, --device, --block-size).
    model: ModelLoadConfig = field(default_factory=ModelLoadConfig)
    block_size: int = 16
    json_path: str | None = setting(
        None, name="json", type=str, help="write the results as JSON to this file"
    )
    quick: bool = setting(False, action="store_true", help="smaller workloads (CI smoke run)")
    repeats: int = setting(
        3,
        type=positive_int,
        help="timed runs of each case per side, alternating (median counts; --quick: 1)",
    )
    # () -> 32, or 8 with `quick`.
    batches: tuple[int, ...] = repeated(
        "batch",
        type=positive_int,
        help="size of a mixed-length batch case (repeatable; default 32, or 8 with --quick)",
    )
    # () -> every shape, or tiny with `quick`; ignored with a `model` path.
    model_shapes: tuple[str, ...] = repeated(
        "model-shape",
        choices=MODEL_SHAPES,
        help="measure this shape (repeatable; default: tiny and smollm-135m, or tiny with"
        " --quick); a random checkpoint of the shape is written by transformers, nothing is"
        " downloaded",
    )


def config_from_args(args: argparse.Namespace) -> EngineBenchConfig:
    """The benchmark's config from its flags (`add_model_flags`' and its own)."""
    return build(EngineBenchConfig, args, model=model_config(args), block_size=args.block_size)
