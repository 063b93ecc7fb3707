"""`python -m pdserve.router.main`: run the router (later wired as `pdserve router`).

Builds `RouterConfig` once from the flags, serves until SIGTERM or SIGINT, then shuts down
gracefully (stops accepting, lets aiohttp finish, closes the worker session) and exits 0. Once
listening it writes `{"url": ..., "pid": ...}` to `--ready-file` atomically (temp + rename), so a
launcher polling for the file never reads half of it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from aiohttp import web

from pdserve.auth.keys import refuse_keys_on_argv
from pdserve.auth.tls import TLSConfig, server_context
from pdserve.child.lifeline import watch_lifeline
from pdserve.child.ready_file import write_ready_file
from pdserve.config_file import add_config_flag
from pdserve.errors import PdserveError
from pdserve.router.access import exposed_warnings
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.router.flags import add_policy_flags, policy_configs
from pdserve.settings import add_fields, build, parse_args


def build_parser() -> argparse.ArgumentParser:
    """The router's command-line flags."""
    p = argparse.ArgumentParser(prog="pdserve router", description=__doc__.splitlines()[0])
    add_config_flag(p)
    # Every flag is declared on its config's field (`pdserve.settings`); the secret's file is
    # listed last, as it always was.
    add_fields(p, RouterConfig, groups=(None, "security"), skip=("cluster_secret",))
    add_policy_flags(p)
    add_fields(p, RouterConfig, only=("cluster_secret",))
    add_fields(p.add_argument_group("TLS (auth/tls.py)"), TLSConfig, prefix="tls-")
    return p


def config_from_args(argv: Sequence[str] | None = None) -> RouterConfig:
    """Parse flags (and a --config file) into a validated RouterConfig."""
    argv = sys.argv[1:] if argv is None else argv
    refuse_keys_on_argv(argv)
    parser = build_parser()
    args = parse_args(parser, argv)
    tls = build(TLSConfig, args, prefix="tls-")
    config = build(RouterConfig, args, tls=tls, **policy_configs(args))
    config.chat_template_text()  # a bad --chat-template fails here, at start
    return config


async def serve(config: RouterConfig) -> None:
    """Run the router until SIGTERM/SIGINT."""
    app = await create_app(config)
    # handler_cancellation: a client that disconnects cancels its handler, and with it the
    # request's flow, which releases what the workers hold (streaming or not).
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, ssl_context=server_context(config.tls))
    await site.start()
    # With --port 0 the kernel picked the port; the runner knows the bound address.
    port = runner.addresses[0][1]
    url = f"{config.tls.scheme}://{config.host}:{port}"
    log = logging.getLogger(__name__)
    log.info("router listening on %s (mode %s)", url, config.mode)
    for warning in exposed_warnings(config.host, config.access_keys):
        log.warning("%s", warning)
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
    watch_lifeline()  # started by a launcher: stop when it dies
    try:
        asyncio.run(serve(config))
    except PdserveError as exc:
        print(f"pdserve router: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
