"""`pdserve bench engine|serve|transfer|multiturn|agents|gpu-check`: benchmarks that print a table
and write JSON with ratios, both sides measured in the same run.

Light at import (argparse only); each benchmark's code is imported when it runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from pdlab.bench.engine_config import MODEL_SHAPES, EngineBenchConfig
from pdlab.bench.gpu_check import STEPS as GPU_CHECK_STEPS
from pdserve.cli.command import add_model_flags, run
from pdserve.config import DEVICES, DTYPES
from pdserve.config_file import add_config_flag
from pdserve.settings import add_fields

HELP = (
    "benchmarks that print a table and ratios"
    " (engine, serve, transfer, multiturn, agents, gpu-check)"
)

__all__ = ["HELP", "MODEL_SHAPES", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The benchmarks' parser, one subcommand each."""
    b = argparse.ArgumentParser(prog="pdserve bench", description=__doc__.splitlines()[0])
    bsub = b.add_subparsers(dest="bench", required=True)
    be = bsub.add_parser("engine", help="engine tokens/s vs transformers, prefix-cache TTFT")
    add_model_flags(be)
    add_fields(be, EngineBenchConfig)
    add_config_flag(be)
    bg = bsub.add_parser(
        "gpu-check",
        help="parity, decode roofline, speed vs transformers, KV over CUDA IPC, a split run"
        " and its faults on a GPU (JSON per step)",
    )
    bg.add_argument("--device", choices=DEVICES, default="cuda")
    bg.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="of the speed runs")
    bg.add_argument("--quick", action="store_true", help="small everything (the CPU smoke run)")
    bg.add_argument(
        "--out", default="gpu-check", help="folder for each step's JSON and gpu_check.json"
    )
    bg.add_argument(
        "--step",
        action="append",
        default=[],
        choices=GPU_CHECK_STEPS,
        help="run only this step (repeatable; default: every one, in order)",
    )
    bg.add_argument(
        "--budget-s",
        type=float,
        default=480.0,
        help="start no step after this many seconds (a device call's limit leaves room)",
    )
    bm = bsub.add_parser(
        "multiturn", help="multi-turn chats: round-robin vs affinity routing on local clusters"
    )
    from pdlab.bench.multiturn import add_arguments

    add_arguments(bm)
    ba = bsub.add_parser(
        "agents", help="tool-using agent sessions: round-robin vs affinity (hit rate, TTFT)"
    )
    from pdlab.bench.agents import add_arguments as add_agents_arguments

    add_agents_arguments(ba)
    bs = bsub.add_parser(
        "serve", help="Poisson load per rate: goodput under TTFT/TPOT SLOs, disagg vs colocated"
    )
    from pdserve.advise.goodput import add_arguments as add_serve_arguments

    add_serve_arguments(bs)
    bt = bsub.add_parser(
        "transfer",
        help="KV handoffs per transport (tcp, shm, nixl) vs memcpy and a raw socket;"
        " TTFT overhead of the split",
    )
    from pdlab.bench.transfer_command import add_arguments as add_transfer_arguments

    add_transfer_arguments(bt)
    return b


def _bench(args: argparse.Namespace) -> int:
    if args.bench == "transfer":
        from pdlab.bench.transfer_command import run_transfer_bench

        return run_transfer_bench(args)
    if args.bench == "serve":
        from pdserve.advise.goodput import run_serve_bench

        return run_serve_bench(args)
    if args.bench == "agents":
        from pdlab.bench.agents import run_agents_bench

        return run_agents_bench(args)
    if args.bench == "multiturn":
        from pdlab.bench.multiturn import run_multiturn_bench

        return run_multiturn_bench(args)
    if args.bench == "gpu-check":
        from pdlab.bench.gpu_check.run import run_gpu_check

        return run_gpu_check(args)
    from pdlab.bench.engine import run_engine_bench

    return run_engine_bench(args)


def main(argv: Sequence[str]) -> int:
    """Run one benchmark (they start local clusters: SIGTERM stops them by PID)."""
    return run("bench", build_parser(), _bench, argv, stop_on_sigterm=True)
