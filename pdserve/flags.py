"""The engine's flags, shared by several commands (the router's are in `router/flags.py`).

`pdserve worker` declares them; `pdserve up` declares them too and passes
the values on to its children (`cli.forwarded`), so the cluster it starts takes every flag
the separate processes take. Light on purpose (no torch, no aiohttp): `pdserve --help` and
`pdserve status` import it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from pdserve.config import EngineConfig, ModelLoadConfig
from pdserve.settings import add_fields, build


def add_engine_flags(p: argparse.ArgumentParser, skip: Sequence[str] = ()) -> None:
    """The engine's flags, from `EngineConfig`'s and `ModelLoadConfig`'s declarations (`pdserve
    up` takes them too and passes them on; `skip`: fields a command declares itself). Which
    model to load (--model, --dtype, --quantization) each command lists where it chooses."""
    e = p.add_argument_group("engine")
    add_fields(e, EngineConfig, skip=skip)
    add_fields(e, ModelLoadConfig, only=("device",))


def engine_config(args: argparse.Namespace, model: ModelLoadConfig, **given: Any) -> EngineConfig:
    """The engine's config from the flags `add_engine_flags` declared, plus `given` fields."""
    return build(EngineConfig, args, model=model, **given)
