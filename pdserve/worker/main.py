"""`python -m pdserve.worker.main` (also `pdserve worker`): one worker process.

Flags are parsed once into a frozen `WorkerConfig` (the engine's part is an `EngineConfig`);
a bad flag or value exits 2 with one line naming it. The process serves until SIGTERM or
SIGINT, then stops gracefully (HTTP closed, held KV released, engine thread joined) and exits 0.
A failure while starting (model folder, port in use) exits 1 with one line.

It knows flags, signals and exit codes; the worker itself is `server.Worker`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Sequence
from typing import NoReturn

from pdserve.auth.tls import TLSConfig
from pdserve.child.lifeline import GRACE_S as LIFELINE_GRACE_S
from pdserve.child.lifeline import watch_lifeline
from pdserve.config import ModelLoadConfig
from pdserve.config_file import add_config_flag
from pdserve.errors import ConfigError, PdserveError
from pdserve.flags import add_engine_flags, engine_config
from pdserve.settings import add_fields, build, parse_args
from pdserve.tasks import cancel_and_wait
from pdserve.worker.config import WorkerConfig
from pdserve.worker.server import Worker

PROG = "pdserve worker"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not usage + error: launchers show it verbatim.
        self.exit(2, f"{PROG}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The worker's flags."""
    p = _Parser(prog=PROG, description="one pdserve worker: HTTP control API + KV endpoint")
    # Every flag is declared on its config's field (`pdserve.settings`).
    add_fields(p, ModelLoadConfig, skip=("device",))
    add_engine_flags(p)
    add_config_flag(p)
    add_fields(p, WorkerConfig)
    add_fields(p.add_argument_group("TLS (auth/tls.py)"), TLSConfig, prefix="tls-")
    return p


def _default_worker_id(args: argparse.Namespace) -> str:
    if args.discovery is None:
        return f"{args.role}-{os.getpid()}"
    # Registered ids are cluster-wide keys: pids alone repeat across machines.
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())
    return f"{args.role}-{host}-{os.getpid()}"


def build_config(args: argparse.Namespace) -> WorkerConfig:
    """The typed config from parsed flags; ConfigError names a bad value."""
    engine = engine_config(
        args,
        build(ModelLoadConfig, args),
        # A worker that sends handoffs keeps its KV where a same-host receiver can read it
        # (one copy over shared memory instead of two); see `transfer/arena.py`.
        shared_kv=args.role in ("prefill", "both") and args.kv_transport in ("auto", "shm"),
    )
    return build(
        WorkerConfig,
        args,
        worker_id=args.worker_id or _default_worker_id(args),
        engine=engine,
        tls=build(TLSConfig, args, prefix="tls-"),
    )


async def serve(config: WorkerConfig) -> None:
    """Run a worker until SIGTERM/SIGINT (or POST /admin/drain), drain it, then stop it. A
    second signal during the drain stops it at once."""
    loop = asyncio.get_running_loop()
    worker = Worker(config)
    now = asyncio.Event()

    def on_signal() -> None:
        if worker.stop_requested.is_set():
            now.set()
        worker.stop_requested.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        url = await worker.start()
        logging.getLogger(__name__).info("worker %s (%s) at %s", config.worker_id, config.role, url)
        await worker.stop_requested.wait()
        if config.drain_timeout_s > 0:
            drain = asyncio.ensure_future(worker.drain(config.drain_timeout_s))
            stop_now = asyncio.ensure_future(now.wait())
            await asyncio.wait((drain, stop_now), return_when=asyncio.FIRST_COMPLETED)
            await cancel_and_wait(drain, stop_now)
    finally:
        await worker.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = build_parser()
    try:
        args = parse_args(parser, sys.argv[1:] if argv is None else argv)
        config = build_config(args)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if config.cluster_secret is None:
        logging.getLogger(__name__).warning(
            "--insecure-no-auth: any process that reaches this worker's ports may call it"
        )
    # Started by a launcher: stop when it dies, after a drain as on SIGTERM.
    watch_lifeline(grace_s=config.drain_timeout_s + LIFELINE_GRACE_S)
    try:
        asyncio.run(serve(config))
    except (PdserveError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    finally:
        # asyncio.run restored the default handlers: a repeated stop signal arriving while
        # the interpreter exits must not turn a graceful stop into a kill.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
