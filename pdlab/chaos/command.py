"""`pdserve chaos`: fault scenarios against real local clusters, with a report; `--soak` runs
sustained load under a seeded nemesis; `--checkpoint-costs` measures a decode worker's death
with decode checkpoints on and off.

Light at import (argparse only); the tooling is imported when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pdserve.cli.command import run
from pdserve.errors import ConfigError
from pdserve.flag_types import positive_int

HELP = "fault scenarios against real local clusters, with a report (--soak: a nemesis soak)"


def build_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    c = argparse.ArgumentParser(prog="pdserve chaos", description=__doc__.splitlines()[0])
    c.add_argument("--scenario", default="all", help="a scenario name, or all (the default)")
    c.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    c.add_argument(
        "--model", default=None, help="Hugging Face model folder (default: tiny built-in)"
    )
    c.add_argument("--requests", type=positive_int, default=6, help="concurrent requests")
    c.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        help="tokens per request (default 24; 64 with --checkpoint-costs)",
    )
    c.add_argument("--workdir", type=Path, default=None, help="logs here (default: a temp dir)")
    c.add_argument(
        "--no-latency-bound",
        action="store_true",
        help="report extra latency without failing on it (on a machine busy with other work)",
    )
    c.add_argument(
        "--concurrency",
        type=positive_int,
        default=1,
        help="scenarios run at once, each on its own cluster (faster; pair with"
        " --no-latency-bound: they share the CPU)",
    )
    c.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="DIR",
        help="draw each scenario's slowest completed request's timeline into DIR (pdserve[plot])",
    )
    soak = c.add_argument_group(
        "soak (sustained load under a seeded nemesis: pdserve chaos --soak 10m)"
    )
    soak.add_argument(
        "--soak", default=None, metavar="DURATION", help="run a soak this long (90, 90s, 10m)"
    )
    soak.add_argument("--rate", default="1.0", help="requests per second (Poisson)")
    soak.add_argument(
        "--nemesis", default="all", metavar="LIST", help="faults: all, or a comma list of names"
    )
    soak.add_argument("--seed", default="0", help="seed of the load and the faults")
    soak.add_argument(
        "--fault-interval-s", default="8", help="at least one fault starts in every such interval"
    )
    soak.add_argument("--fault-free-s", default="30", help="seconds of the fault-free phase")
    soak.add_argument(
        "--lease-ttl-s", default="4", help="the routers' lease TTL (pauses longer outlive it)"
    )
    soak.add_argument("--min-availability", default="0.99", help="target, excluding router kills")
    soak.add_argument("--history", type=Path, default=None, help="write the history (JSON lines)")
    soak.add_argument(
        "--no-netns", action="store_true", help="keep workers on loopback (no partition fault)"
    )
    soak.add_argument(
        "--check", type=Path, default=None, metavar="HISTORY", help="judge a stored history again"
    )
    costs = c.add_argument_group(
        "decode checkpoints (pdserve chaos --checkpoint-costs: decode death with them on vs off)"
    )
    costs.add_argument(
        "--checkpoint-costs",
        action="store_true",
        help="kill the decode worker mid-decode at each context length, checkpoints on and"
        " off: time to the next token, tokens recomputed, KV bytes pulled",
    )
    costs.add_argument(
        "--contexts",
        type=_context_list,
        default=(512, 2048, 8192),
        help="prompt lengths in tokens, comma-separated (default 512,2048,8192)",
    )

    return c


def _number(flag: str, text: str, kind: type[int] | type[float]) -> float:
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{flag}: {text!r} is not a valid {kind.__name__}") from None


def _cmd_soak(args: argparse.Namespace) -> int:
    from pdlab.soak.history import SoakTargets
    from pdlab.soak.nemesis_plan import parse_nemesis
    from pdlab.soak.report import check_history
    from pdlab.soak.run import SoakConfig, parse_duration, run_soak

    if args.check is not None:
        return check_history(args.check, args.json)
    import logging

    # Progress on stderr: phases, each fault applied, each restart (not per-request lines).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("pdserve.timeline").setLevel(logging.WARNING)
    config = SoakConfig(
        duration_s=parse_duration(args.soak),
        rate=_number("--rate", args.rate, float),
        nemesis=parse_nemesis(args.nemesis),
        seed=int(_number("--seed", args.seed, int)),
        fault_interval_s=_number("--fault-interval-s", args.fault_interval_s, float),
        fault_free_s=_number("--fault-free-s", args.fault_free_s, float),
        model=args.model,
        workdir=args.workdir,
        json_path=args.json,
        history_path=args.history,
        plot_dir=args.plot,
        use_netns=not args.no_netns,
        lease_ttl_s=_number("--lease-ttl-s", args.lease_ttl_s, float),
        targets=SoakTargets(_number("--min-availability", args.min_availability, float)),
    )
    return run_soak(config, "pdserve " + " ".join(sys.argv[1:]))


def _context_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None
    if not values or min(values) < 16:
        raise argparse.ArgumentTypeError(f"{text!r}: every context must be >= 16 tokens")
    return values


def _cmd_chaos(args: argparse.Namespace) -> int:
    from pdlab.chaos.run import ChaosConfig, run_chaos
    from pdlab.chaos.scenarios import find_scenarios

    if args.soak is not None or args.check is not None:
        return _cmd_soak(args)
    if args.checkpoint_costs:
        from pdlab.chaos.checkpoint_costs import CostConfig, run_costs

        return run_costs(
            CostConfig(
                contexts=args.contexts,
                max_tokens=args.max_tokens or 64,
                model=args.model,
                json_path=args.json,
                workdir=args.workdir,
            )
        )

    config = ChaosConfig(
        scenarios=find_scenarios(args.scenario),
        model=args.model,
        num_requests=args.requests,
        max_tokens=args.max_tokens or 24,
        json_path=args.json,
        workdir=args.workdir,
        strict_latency=not args.no_latency_bound,
        plot_dir=args.plot,
        concurrency=args.concurrency,
    )
    return run_chaos(config)


def main(argv: Sequence[str]) -> int:
    """Run the command (it starts local clusters: SIGTERM stops them by PID)."""
    return run("chaos", build_parser(), _cmd_chaos, argv, stop_on_sigterm=True)
