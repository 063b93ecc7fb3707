"""The `pdserve` command line: parses flags once into typed config and hands each part its own.

Commands: `generate` (one completion on the local engine), `up` (router and workers on
loopback), `worker` and `router` (one process each), `status` and `top` (a cluster's workers,
blocks and load, once or live), `trace` (one request's timeline), `bench engine` (engine
throughput against transformers), `bench multiturn` (routing on multi-turn chats), `bench
serve` (goodput under SLOs at Poisson rates, disagg against colocated), `bench transfer` (KV
handoffs per transport against memcpy and a raw socket, and the split's TTFT overhead),
`advise` (goodput curves of colocated and every P:D split on the user's workload, and a
recommendation). A bad flag or config value exits with status 2 and one line naming it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pdserve.config import DEVICES, DTYPES
from pdserve.config_file import add_config_flag
from pdserve.errors import ConfigError, PdserveError
from pdserve.flags import add_engine_flags, add_policy_flags
from pdserve.supervise.process import exit_on_sigterm


def _int_in(text: str, low: int, high: int | None, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _int_in(text, 1, None, "a positive integer")


def _non_negative_int(text: str) -> int:
    return _int_in(text, 0, None, "an integer >= 0")


def _float_in(text: str, low: float, strict: bool, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not value < float("inf") or value < low or (strict and value == low):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
    return value


def _positive_float(text: str) -> float:
    return _float_in(text, 0.0, True, "a number > 0")


def _non_negative_float(text: str) -> float:
    return _float_in(text, 0.0, False, "a number >= 0")


def _port(text: str) -> int:
    return _int_in(text, 0, 65535, "a port 0..65535")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="Hugging Face model folder (default: tiny built-in)"
    )
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="float16: CUDA only")
    p.add_argument("--quantization", default=None, choices=["int8"])
    p.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block")
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="auto: CUDA when torch has it and a GPU is visible, else the CPU",
    )


# `pdserve bench engine --model-shape` choices: "tiny" and `bench.model_shapes.SHAPES`.
MODEL_SHAPES = ("tiny", "smollm-135m")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt with the local engine")
    g.add_argument("prompt")
    _add_model_flags(g)
    g.add_argument("--max-tokens", type=_positive_int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")

    u = sub.add_parser("up", help="start a router and workers on loopback; Ctrl-C stops all")
    u.add_argument(
        "--prefill",
        type=_non_negative_int,
        default=None,
        help="prefill workers (default 1; 0 with --mode auto)",
    )
    u.add_argument("--decode", type=_positive_int, default=1, help="decode workers (role both)")
    u.add_argument(
        "--mode",
        choices=["disagg", "colocated", "auto"],
        default="disagg",
        help="auto: the router splits the `both` workers into prefill and decode roles itself",
    )
    u.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="extra `pdserve router` flag, e.g. --router-arg=--slo-tpot-ms=30 (repeatable)",
    )
    u.add_argument(
        "--model", default=None, help="Hugging Face model folder (default: tiny built-in)"
    )
    u.add_argument("--dtype", default="float32", choices=DTYPES, help="float16: CUDA only")
    u.add_argument("--block-size", type=_positive_int, default=16)
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=_port, default=8000, help="first router's port (then +1, ...)")
    u.add_argument("--api-key", default=None)
    add_config_flag(u)
    u.set_defaults(router_flags=_added(u, add_policy_flags, max_model_len=False))
    u.set_defaults(worker_flags=_added(u, add_engine_flags))
    u.add_argument("--routers", type=_positive_int, default=1, help="routers (one port each)")
    membership = u.add_mutually_exclusive_group()
    membership.add_argument(
        "--etcd", action="store_true", help="start a local etcd; workers register, routers watch"
    )
    membership.add_argument(
        "--discovery", default=None, metavar="etcd://HOST:PORT[/PREFIX]", help="an existing etcd"
    )
    u.add_argument(
        "--max-restarts",
        type=_non_negative_int,
        default=5,
        help="exits of one process within --restart-window-s before it is given up",
    )
    u.add_argument("--restart-window-s", type=_positive_float, default=60.0)
    u.add_argument(
        "--liveness-timeout-s",
        type=_non_negative_float,
        default=30.0,
        help="kill and restart a process that answers no health probe this long (0: never)",
    )

    st = sub.add_parser("status", help="router, mode and workers of a running cluster")
    st.add_argument("--url", default=None, help="router URL (default: the running `pdserve up`)")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")

    tp = sub.add_parser("top", help="live view of workers, blocks, load and request latencies")
    tp.add_argument("--url", default=None, help="router URL (default: the running `pdserve up`)")
    tp.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    tp.add_argument("--once", action="store_true", help="print one frame, no escape codes")

    tr = sub.add_parser("trace", help="one request's timeline as a waterfall")
    tr.add_argument("request_id", help="the id of the OpenAI response (cmpl-…, chatcmpl-…)")
    tr.add_argument("--url", default=None, help="router URL (default: the running `pdserve up`)")
    tr.add_argument("--json", action="store_true", help="print the timeline JSON")
    tr.add_argument(
        "--merged",
        action="store_true",
        help="add the workers' events, aligned to the router's clock",
    )
    tr.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE",
        help="also draw the merged timeline into FILE (PNG; needs pdserve[plot])",
    )

    for name, what in (
        ("worker", "one worker process"),
        ("router", "the OpenAI-compatible router"),
    ):
        # Listed for the top-level help only: `main` hands these commands' arguments, --help
        # included, straight to the process's own parser.
        w = sub.add_parser(name, help=f"run {what} (pdserve {name} --help: its flags)")
        w.add_argument("args", nargs=argparse.REMAINDER)

    c = sub.add_parser("chaos", help="fault scenarios against real local clusters, with a report")
    c.add_argument("--scenario", default="all", help="a scenario name, or all (the default)")
    c.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    c.add_argument(
        "--model", default=None, help="Hugging Face model folder (default: tiny built-in)"
    )
    c.add_argument("--requests", type=_positive_int, default=6, help="concurrent requests")
    c.add_argument(
        "--max-tokens",
        type=_positive_int,
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

    a = sub.add_parser(
        "advise",
        help="colocated or split, and which P:D ratio: goodput curves on your workload",
    )
    from pdserve.bench.advise import add_arguments as add_advise_arguments

    add_advise_arguments(a)

    b = sub.add_parser("bench", help="benchmarks that print a table and ratios")
    bsub = b.add_subparsers(dest="bench", required=True)
    be = bsub.add_parser("engine", help="engine tokens/s vs transformers, prefix-cache TTFT")
    _add_model_flags(be)
    be.add_argument("--json", default=None, help="write the results as JSON to this file")
    be.add_argument("--quick", action="store_true", help="smaller workloads (CI smoke run)")
    be.add_argument(
        "--repeats",
        type=_positive_int,
        default=3,
        help="timed runs of each case per side, alternating (median counts; --quick: 1)",
    )
    be.add_argument(
        "--batch",
        action="append",
        type=_positive_int,
        default=None,
        help="size of a mixed-length batch case (repeatable; default 32, or 8 with --quick)",
    )
    be.add_argument(
        "--model-shape",
        action="append",
        # Spelled out here so the CLI parses without importing torch; a unit test keeps it
        # equal to `bench.model_shapes.SHAPES`.
        choices=MODEL_SHAPES,
        default=None,
        help="measure this shape (repeatable; default: both, or tiny with --quick); a random"
        " checkpoint of the shape is written by transformers, nothing is downloaded",
    )
    bg = bsub.add_parser(
        "gpu-check", help="parity, engine speed and a disaggregated run on a GPU (JSON)"
    )
    bg.add_argument("--device", choices=DEVICES, default="cuda")
    bg.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="of the speed runs")
    bg.add_argument("--quick", action="store_true", help="small everything (the CPU smoke run)")
    bg.add_argument("--json", default=None, help="write the report here")
    bm = bsub.add_parser(
        "multiturn", help="multi-turn chats: round-robin vs affinity routing on local clusters"
    )
    from pdserve.bench.multiturn import add_arguments

    add_arguments(bm)
    bs = bsub.add_parser(
        "serve", help="Poisson load per rate: goodput under TTFT/TPOT SLOs, disagg vs colocated"
    )
    from pdserve.bench.serve import add_arguments as add_serve_arguments

    add_serve_arguments(bs)
    bt = bsub.add_parser(
        "transfer",
        help="KV handoffs per transport (tcp, shm, nixl) vs memcpy and a raw socket;"
        " TTFT overhead of the split",
    )
    from pdserve.bench.transfer_command import add_arguments as add_transfer_arguments

    add_transfer_arguments(bt)
    return parser


def _cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        block_size=args.block_size,
    )
    out = llm.generate([args.prompt], params)[0]
    print(args.prompt + out.text)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "transfer":
        from pdserve.bench.transfer_command import run_transfer_bench

        return run_transfer_bench(args)
    if args.bench == "serve":
        from pdserve.bench.serve import run_serve_bench

        return run_serve_bench(args)
    if args.bench == "multiturn":
        from pdserve.bench.multiturn import run_multiturn_bench

        return run_multiturn_bench(args)
    if args.bench == "gpu-check":
        from pdserve.bench.gpu_check import run_gpu_check

        return run_gpu_check(args)
    from pdserve.bench.engine_bench import run_engine_bench

    return run_engine_bench(args)


def _number(flag: str, text: str, kind: type[int] | type[float]) -> float:
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{flag}: {text!r} is not a valid {kind.__name__}") from None


def _cmd_soak(args: argparse.Namespace) -> int:
    from pdserve.bench.nemesis_plan import parse_nemesis
    from pdserve.bench.soak import SoakConfig, parse_duration, run_soak
    from pdserve.bench.soak_history import SoakTargets
    from pdserve.bench.soak_report import check_history

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
    from pdserve.bench.chaos import ChaosConfig, run_chaos
    from pdserve.bench.chaos_scenarios import find_scenarios

    if args.soak is not None or args.check is not None:
        return _cmd_soak(args)
    if args.checkpoint_costs:
        from pdserve.bench.checkpoint_costs import CostConfig, run_costs

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
    )
    return run_chaos(config)


def _added(
    parser: argparse.ArgumentParser, add: Callable[..., None], **kwargs: bool
) -> list[argparse.Action]:
    """The actions `add(parser, **kwargs)` declares (to pass their values on later)."""
    before = len(parser._actions)
    add(parser, **kwargs)
    return parser._actions[before:]


def forwarded(actions: Sequence[argparse.Action], args: argparse.Namespace) -> list[str]:
    """The flags that give a child process the values `args` holds for `actions` (values
    left at their defaults are not repeated)."""
    argv: list[str] = []
    for action in actions:
        value = getattr(args, action.dest)
        if value == action.default or value is None:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def _cmd_up(args: argparse.Namespace) -> int:
    from pdserve.launcher import UpConfig, run_up
    from pdserve.supervise.policy import RestartPolicy

    worker_args = forwarded(args.worker_flags, args)
    # The router checks prompt lengths against the same limit the workers enforce.
    max_len = ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
    num_prefill = args.prefill if args.prefill is not None else (0 if args.mode == "auto" else 1)
    config = UpConfig(
        num_prefill=num_prefill,
        num_decode=args.decode,
        mode=args.mode,
        model=args.model,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        block_size=args.block_size,
        api_key=args.api_key,
        router_args=tuple(forwarded(args.router_flags, args) + max_len + args.router_arg),
        worker_args=tuple(worker_args),
        num_routers=args.routers,
        discovery=args.discovery,
        local_etcd=args.etcd,
        restart=RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window_s),
        liveness_timeout_s=args.liveness_timeout_s or None,
    )
    return run_up(config)


def _cmd_status(args: argparse.Namespace) -> int:
    import dataclasses

    from pdserve.status import (
        collect_status,
        find_router_url,
        read_processes,
        render_json,
        render_table,
    )

    url = find_router_url(args.url)
    status = dataclasses.replace(collect_status(url), processes=read_processes(url))
    print(render_json(status) if args.json else render_table(status))
    return 0


def _cmd_top(args: argparse.Namespace) -> int:
    from pdserve.status import find_router_url
    from pdserve.top import run_top

    if args.interval <= 0:
        print("pdserve top: error: --interval must be > 0", file=sys.stderr)
        return 2
    return run_top(find_router_url(args.url), args.interval, args.once)


def _cmd_trace(args: argparse.Namespace) -> int:
    import json

    from pdserve.observability.trace import fetch_timeline, render_waterfall
    from pdserve.status import find_router_url

    merged = args.merged or args.plot is not None
    view = fetch_timeline(find_router_url(args.url), args.request_id, workers=merged)
    print(json.dumps(view, indent=2) if args.json else render_waterfall(view))
    if args.plot is not None:
        from pdserve.observability.plot import save_plot

        save_plot(view, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def process_command(argv: Sequence[str]) -> tuple[str, list[str]] | None:
    """("worker" | "router", that process's own argv) when `argv` runs one, else None."""
    if argv[:1] not in (["worker"], ["router"]):
        return None
    rest = list(argv[1:])
    # A leading "--" (the older `pdserve worker -- FLAGS` spelling) is not the process's flag.
    return argv[0], rest[1:] if rest[:1] == ["--"] else rest


def _run_process(command: str, argv: list[str]) -> int:
    if command == "worker":
        from pdserve.worker.main import main as worker_main

        return worker_main(argv)
    from pdserve.router.main import main as router_main

    return router_main(argv)


def _expand_config(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """argv with `pdserve up --config FILE` expanded into flags (the command's own parser
    checks every key)."""
    if argv[:1] != ["up"]:
        return argv
    from pdserve.config_file import expand

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[
        "up"
    ]
    return ["up", *expand(argv[1:], sub)]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pdserve` script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if (process := process_command(argv)) is not None:
        return _run_process(*process)
    parser = build_parser()
    try:
        args = parser.parse_args(_expand_config(parser, argv))
    except PdserveError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    if args.command in ("bench", "advise", "chaos"):
        # These start local clusters: a SIGTERM must run their `finally` (stop by PID), not
        # leave the workers and routers behind.
        exit_on_sigterm()
    try:
        if args.command == "generate":
            return _cmd_generate(args)
        if args.command == "bench":
            return _cmd_bench(args)
        if args.command == "advise":
            from pdserve.bench.advise import run_advise_command

            return run_advise_command(args)
        if args.command == "up":
            return _cmd_up(args)
        if args.command == "chaos":
            return _cmd_chaos(args)
        if args.command == "status":
            return _cmd_status(args)
        if args.command == "trace":
            return _cmd_trace(args)
        if args.command == "top":
            return _cmd_top(args)
    except PdserveError as exc:
        print(f"pdserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 2
