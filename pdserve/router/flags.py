"""The router's serving, placement and recovery flags: declared here, beside the router's
config, and taken by `pdserve router` and `pdserve up` (which passes them on to the router it
starts, `cli.forwarded`). Light on purpose (no torch, no aiohttp): `pdserve --help` imports it.
"""

from __future__ import annotations

import argparse

from pdserve.router.config import (
    RECOVERY_STEPS,
    ROUTINGS,
    AffinityConfig,
    BreakerConfig,
    RecoveryConfig,
)
from pdserve.router.mode.auto_mode import AutoConfig
from pdserve.router.mode.interference import SLOConfig

_BREAKER = BreakerConfig()
_RECOVERY = RecoveryConfig()
_AFFINITY = AffinityConfig()
_SLO = SLOConfig()
_AUTO = AutoConfig()


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
    b = p.add_argument_group("circuit breaker (KV path failures -> colocated)")
    b.add_argument("--no-breaker", action="store_true", help="never switch mode automatically")
    b.add_argument("--breaker-window", type=int, default=_BREAKER.window)
    b.add_argument("--breaker-min-samples", type=int, default=_BREAKER.min_samples)
    b.add_argument("--breaker-failure-rate", type=float, default=_BREAKER.failure_rate)
    b.add_argument("--breaker-cooldown-s", type=float, default=_BREAKER.cooldown_s)
    a = p.add_argument_group("placement (prefix and session affinity against load)")
    a.add_argument("--routing", choices=ROUTINGS, default=_AFFINITY.routing)
    a.add_argument(
        "--prefix-weight",
        type=float,
        default=_AFFINITY.prefix_weight,
        help="cost of one prompt block the worker does not hold",
    )
    a.add_argument(
        "--load-weight",
        type=float,
        default=_AFFINITY.load_weight,
        help="cost of one request already on the worker",
    )
    a.add_argument(
        "--local-prefill-threshold",
        type=int,
        default=_AFFINITY.local_prefill_threshold,
        help="uncached prompt tokens a decode worker holding the rest prefills itself (0: never)",
    )
    a.add_argument("--max-sessions", type=int, default=_AFFINITY.max_sessions)
    s = p.add_argument_group("SLOs (attainment metrics, pdserve top, --mode auto)")
    s.add_argument("--slo-ttft-ms", type=float, default=_SLO.ttft_s * 1e3)
    s.add_argument("--slo-tpot-ms", type=float, default=_SLO.tpot_s * 1e3)
    au = p.add_argument_group("automatic mode (--mode auto)")
    au.add_argument("--auto-interval-s", type=float, default=_AUTO.interval_s)
    au.add_argument(
        "--auto-window-s",
        type=float,
        default=_AUTO.window_s,
        help="seconds of live figures each decision (and the attainment gauges) covers",
    )
    au.add_argument(
        "--auto-min-dwell-s",
        type=float,
        default=_AUTO.min_dwell_s,
        help="no change of mode or ratio within this long of the previous one",
    )
    au.add_argument(
        "--auto-sustain",
        type=int,
        default=_AUTO.sustain,
        help="consecutive evaluations that must propose the same change",
    )
    au.add_argument("--auto-min-requests", type=int, default=_AUTO.min_requests)
    au.add_argument("--auto-target-attainment", type=float, default=_AUTO.target_attainment)
    au.add_argument(
        "--auto-low-water",
        type=float,
        default=_AUTO.low_water,
        help="back to colocated below this fraction of the prompt tokens/s at the split",
    )
    au.add_argument(
        "--auto-split-backoff-s",
        type=float,
        default=_AUTO.split_backoff_s,
        help="after a split was undone for not helping, no new split for this long",
    )
    r = p.add_argument_group("recovery after a failed handoff")
    r.add_argument(
        "--recovery",
        default=",".join(_RECOVERY.steps),
        help=f"ordered steps from {','.join(RECOVERY_STEPS)}, or 'none'",
    )
    r.add_argument("--transfer-attempts", type=int, default=_RECOVERY.transfer_attempts)
    r.add_argument("--max-reprefills", type=int, default=_RECOVERY.max_reprefills)
    r.add_argument("--max-migrations", type=int, default=_RECOVERY.max_migrations)
    r.add_argument("--queue-timeout-s", type=float, default=_RECOVERY.queue_timeout_s)
    r.add_argument("--max-queued", type=int, default=_RECOVERY.max_queued)
    r.add_argument(
        "--checkpoint",
        default=_RECOVERY.checkpoint,
        help="decode checkpoints: off, prompt or every-N (replicate a decoding request's KV"
        " every N filled blocks to another decode worker, so a migration resumes from it)",
    )
    r.add_argument(
        "--checkpoint-lease-ttl-s",
        type=float,
        default=_RECOVERY.checkpoint_lease_ttl_s,
        help="a holder drops a request's checkpoint this long after its decode worker stops"
        " renewing",
    )
