"""`pdserve up`: a router and its workers on loopback, supervised; Ctrl-C or SIGTERM stops all.

It takes every flag of the router's policy and of the workers' engines and passes the values
that differ from their defaults on to its children, so one command line (or one `--config`
file) configures the whole cluster.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from pdserve.auth.keys import refuse_keys_on_argv
from pdserve.auth.tls import TLSConfig
from pdserve.cli.command import run
from pdserve.config_file import add_config_flag
from pdserve.errors import ConfigError
from pdserve.flags import add_engine_flags
from pdserve.router.flags import add_policy_flags
from pdserve.settings import add_fields, build
from pdserve.supervise import launcher
from pdserve.supervise.launcher import UpConfig
from pdserve.supervise.policy import RestartPolicy

# `UpConfig`'s flags listed first in --help, before the router's and the engines'.
_FIRST = ("num_prefill", "num_decode", "mode", "router_args", "model", "dtype", "block_size",
          "host", "port", "api_key", "admin_key")  # fmt: skip


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
    """The command's flags: its own (declared on `UpConfig`), the router's policy flags and
    the engine's."""
    u = argparse.ArgumentParser(prog="pdserve up", description=__doc__.splitlines()[0])
    add_fields(u, UpConfig, only=_FIRST)
    add_config_flag(u)
    u.set_defaults(router_flags=_added(u, add_policy_flags, max_model_len=False))
    u.set_defaults(worker_flags=_added(u, add_engine_flags, skip=("block_size",)))
    add_fields(u, UpConfig, only=("num_routers",))
    add_fields(u.add_mutually_exclusive_group(), UpConfig, only=("local_etcd", "discovery"))
    add_fields(u, RestartPolicy)
    add_fields(u, UpConfig, only=("liveness_timeout_s",))
    # One set of TLS files for every router and worker (mutual between them with --tls-ca).
    add_fields(u.add_argument_group("TLS (auth/tls.py)"), TLSConfig, prefix="tls-")
    return u


def config_from_args(args: argparse.Namespace) -> UpConfig:
    """The cluster to start, from the parsed flags."""
    # The router checks prompt lengths against the same limit the workers enforce.
    max_len = ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
    tls = build(TLSConfig, args, prefix="tls-")
    router_args = forwarded(args.router_flags, args) + max_len + tls.args() + args.router_arg
    num_prefill = args.prefill if args.prefill is not None else (0 if args.mode == "auto" else 1)
    return build(
        UpConfig,
        args,
        num_prefill=num_prefill,
        router_args=tuple(router_args),
        worker_args=tuple(forwarded(args.worker_flags, args) + tls.args()),
        restart=build(RestartPolicy, args),
        tls=tls,
    )


def _up(args: argparse.Namespace) -> int:
    return launcher.run_up(config_from_args(args))


def main(argv: Sequence[str]) -> int:
    """Run the command; returns the exit status."""
    try:
        refuse_keys_on_argv(argv)
    except ConfigError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    return run("up", build_parser(), _up, argv)
