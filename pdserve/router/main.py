"""`python -m pdserve.router.main`: run the router (later wired as `pdserve router`).

Builds `RouterConfig` once from the flags, serves until SIGTERM or SIGINT, then shuts down
gracefully (stops accepting, lets aiohttp finish, closes the worker session) and exits 0. Once
listening it writes `{"url": ..., "pid": ...}` to `--ready-file` atomically (temp + rename), so a
launcher polling for the file never reads half of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from pdserve.auth.secret import load_secret
from pdserve.config_file import add_config_flag
from pdserve.errors import PdserveError
from pdserve.router.app import create_app
from pdserve.router.config import (
    MODE_SETTINGS,
    RouterConfig,
    parse_mode_setting,
)
from pdserve.router.flags import add_policy_flags, policy_configs
from pdserve.settings import parse_args


def build_parser() -> argparse.ArgumentParser:
    """The router's command-line flags."""
    p = argparse.ArgumentParser(prog="pdserve router", description=__doc__.splitlines()[0])
    add_config_flag(p)
    p.add_argument("--worker", action="append", default=[], help="worker base URL (repeatable)")
    p.add_argument(
        "--discovery",
        default=None,
        metavar="etcd://HOST:PORT[/PREFIX]",
        help="find workers registered in etcd instead of --worker URLs",
    )
    p.add_argument(
        "--mode",
        choices=MODE_SETTINGS,
        default="disagg",
        help="auto: start colocated, split `both` workers into prefill and decode roles when"
        " prefill breaks the TPOT SLO, rejoin them when the load falls or the breaker opens",
    )
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="tests only: inject SITE:ACTION[:key=value,...] at a router site (repeatable)",
    )
    p.add_argument("--fault-seed", type=int, default=0, help="seed of the fault plan's draws")
    p.add_argument("--model", default=None, help="model folder (default: the tiny built-in)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--ready-file", type=Path, default=None)
    p.add_argument(
        "--health-deadline-s",
        type=float,
        default=3.0,
        help="cut a worker's open streams once its health polls failed this long (0: never)",
    )
    p.add_argument(
        "--timeline-ring",
        type=int,
        default=1000,
        help="recent requests whose timelines /debug/requests/{id} keeps",
    )
    add_policy_flags(p)
    sec = p.add_argument_group("security")
    sec.add_argument(
        "--cluster-secret-file",
        type=Path,
        default=None,
        help="the cluster secret (else $PDSERVE_CLUSTER_SECRET): signs every worker call",
    )
    sec.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="talk to workers started with --insecure-no-auth (no credential)",
    )
    return p


def config_from_args(argv: Sequence[str] | None = None) -> RouterConfig:
    """Parse flags (and a --config file) into a validated RouterConfig."""
    parser = build_parser()
    args = parse_args(parser, sys.argv[1:] if argv is None else argv)
    if args.model is None:
        from pdserve.model.tiny import default_model_path

        model = default_model_path()
    else:
        model = Path(args.model)
    config = RouterConfig(
        cluster_secret=load_secret(args.cluster_secret_file),
        insecure_no_auth=args.insecure_no_auth,
        workers=tuple(args.worker),
        discovery=args.discovery,
        faults=tuple(args.fault),
        fault_seed=args.fault_seed,
        model=model,
        mode=parse_mode_setting(args.mode),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        ready_file=args.ready_file,
        request_timeout_s=args.request_timeout_s,
        lease_ttl_s=args.lease_ttl_s,
        timeline_ring=args.timeline_ring,
        served_model_names=tuple(args.served_model_name or ()),
        max_model_len=args.max_model_len,
        chat_template=args.chat_template,
        allow_unknown_fields=args.allow_unknown_fields,
        health_deadline_s=args.health_deadline_s,
        **policy_configs(args),
    )
    config.chat_template_text()  # a bad --chat-template fails here, at start
    return config


def write_ready_file(path: Path, url: str) -> None:
    """Write {"url", "pid"} to `path` atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid()}))
    os.replace(tmp, path)


async def serve(config: RouterConfig) -> None:
    """Run the router until SIGTERM/SIGINT."""
    app = await create_app(config)
    # handler_cancellation: a client that disconnects cancels its handler, and with it the
    # request's flow, which releases what the workers hold (streaming or not).
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    # With --port 0 the kernel picked the port; the runner knows the bound address.
    port = runner.addresses[0][1]
    url = f"http://{config.host}:{port}"
    logging.getLogger(__name__).info("router listening on %s (mode %s)", url, config.mode)
    if config.ready_file is not None:
        write_ready_file(config.ready_file, url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    try:
        config = config_from_args(argv)
    except PdserveError as exc:
        print(f"pdserve router: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except PdserveError as exc:
        print(f"pdserve router: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
