"""The router's serving, placement and recovery flags, taken by `pdserve router` and `pdserve
up` (which passes them on to the router it starts, `cli.forwarded`). The policy flags are
declared on their config's fields (`pdserve.settings`); the serving ones here. Light on
purpose (no torch, no aiohttp): `pdserve --help` imports it.
"""

from __future__ import annotations

import argparse
from typing import Any

from pdserve.router.config import (
    SERVING,
    AffinityConfig,
    BreakerConfig,
    RecoveryConfig,
    RouterConfig,
)
from pdserve.router.mode.auto_mode import AutoConfig
from pdserve.router.mode.interference import SLOConfig
from pdserve.settings import add_fields, build


def add_policy_flags(p: argparse.ArgumentParser, max_model_len: bool = True) -> None:
    """The router's serving, placement and recovery flags (`pdserve up` takes them too, with
    `--max-model-len` from the engine's flags)."""
    skip = () if max_model_len else ("max_model_len",)
    add_fields(p, RouterConfig, skip=skip, groups=(SERVING,))
    add_fields(p.add_argument_group("circuit breaker (KV path failures -> colocated)"),
               BreakerConfig, prefix="breaker-")  # fmt: skip
    add_fields(p.add_argument_group("placement (prefix and session affinity against load)"),
               AffinityConfig)  # fmt: skip
    add_fields(p.add_argument_group("SLOs (attainment metrics, pdserve top, --mode auto)"),
               SLOConfig)  # fmt: skip
    add_fields(p.add_argument_group("automatic mode (--mode auto)"), AutoConfig, prefix="auto-")
    add_fields(p.add_argument_group("recovery after a failed handoff"), RecoveryConfig)


def policy_configs(args: argparse.Namespace) -> dict[str, Any]:
    """The router's policy sub-configs from the flags `add_policy_flags` declared."""
    return {
        "breaker": build(BreakerConfig, args, prefix="breaker-"),
        "affinity": build(AffinityConfig, args),
        "slo": build(SLOConfig, args),
        "auto": build(AutoConfig, args, prefix="auto-"),
        "recovery": build(RecoveryConfig, args),
    }
