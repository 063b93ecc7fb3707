"""The router's serving, placement and recovery flags, taken by `pdserve router` and `pdserve
up` (which passes them on to the router it starts, `cli.forwarded`). The policy flags are
declared on their config's fields (`pdserve.settings`); the serving ones here. Light on
purpose (no torch, no aiohttp): `pdserve --help` imports it.
"""

from __future__ import annotations

import argparse
from typing import Any

from pdserve.router.config import AffinityConfig, BreakerConfig, RecoveryConfig
from pdserve.router.mode.auto_mode import AutoConfig
from pdserve.router.mode.interference import SLOConfig
from pdserve.settings import add_fields, build


def add_policy_flags(p: argparse.ArgumentParser, max_model_len: bool = True) -> None:
    """The router's serving, placement and recovery flags (`pdserve up` takes them too, with
    `--max-model-len` from the engine's flags)."""
    s = p.add_argument_group("serving (OpenAI API)")
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names clients pass as `model` (default: the model folder's name)",
    )
    if max_model_len:
        s.add_argument(
            "--max-model-len",
            type=int,
            default=None,
            help="longest prompt + output in tokens (default: the model's max_position_embeddings)",
        )
    s.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, or a file holding one, replacing the tokenizer's",
    )
    s.add_argument(
        "--allow-unknown-fields",
        action="store_true",
        help="drop (and log) unknown request fields instead of answering 400",
    )
    s.add_argument("--request-timeout-s", type=float, default=600.0, help="per-request deadline")
    s.add_argument(
        "--lease-ttl-s", type=float, default=30.0, help="decode reservation / prefill KV lease"
    )
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
