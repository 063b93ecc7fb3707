"""`pdserve up`: a router and its workers on loopback, supervised; Ctrl-C or SIGTERM stops all.

It takes every flag of the router's policy and of the workers' engines and passes the values
that differ from their defaults on to its children, so one command line (or one `--config`
file) configures the whole cluster.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from pdserve.cli.command import (
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    run,
)
from pdserve.config import DTYPES
from pdserve.config_file import add_config_flag
from pdserve.flags import add_engine_flags
from pdserve.router.flags import add_policy_flags


def _added(
    parser: argparse.ArgumentParser, add: Callable[..., None], **kwargs: object
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


def build_parser() -> argparse.ArgumentParser:
    """The command's flags: its own, the router's policy flags and the engine's."""
    u = argparse.ArgumentParser(prog="pdserve up", description=__doc__.splitlines()[0])
    u.add_argument(
        "--prefill",
        type=non_negative_int,
        default=None,
        help="prefill workers (default 1; 0 with --mode auto)",
    )
    u.add_argument("--decode", type=positive_int, default=1, help="decode workers (role both)")
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
    u.add_argument("--block-size", type=positive_int, default=16)
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=port, default=8000, help="first router's port (then +1, ...)")
    u.add_argument("--api-key", default=None)
    add_config_flag(u)
    u.set_defaults(router_flags=_added(u, add_policy_flags, max_model_len=False))
    u.set_defaults(worker_flags=_added(u, add_engine_flags, skip=("block_size",)))
    u.add_argument("--routers", type=positive_int, default=1, help="routers (one port each)")
    membership = u.add_mutually_exclusive_group()
    membership.add_argument(
        "--etcd", action="store_true", help="start a local etcd; workers register, routers watch"
    )
    membership.add_argument(
        "--discovery", default=None, metavar="etcd://HOST:PORT[/PREFIX]", help="an existing etcd"
    )
    u.add_argument(
        "--max-restarts",
        type=non_negative_int,
        default=5,
        help="exits of one process within --restart-window-s before it is given up",
    )
    u.add_argument("--restart-window-s", type=positive_float, default=60.0)
    u.add_argument(
        "--liveness-timeout-s",
        type=non_negative_float,
        default=30.0,
        help="kill and restart a process that answers no health probe this long (0: never)",
    )
    return u


def _up(args: argparse.Namespace) -> int:
    from pdserve.supervise.launcher import UpConfig, run_up
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


def main(argv: Sequence[str]) -> int:
    """Run the command; returns the exit status."""
    return run("up", build_parser(), _up, argv)
