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
from pathlib import Path
from typing import NoReturn

from pdserve.auth.secret import load_secret
from pdserve.config import DTYPES, ModelLoadConfig
from pdserve.config_file import add_config_flag
from pdserve.errors import ConfigError, PdserveError
from pdserve.flags import add_engine_flags, engine_config
from pdserve.settings import parse_args
from pdserve.worker.config import KV_TRANSPORTS, ROLES, WorkerConfig
from pdserve.worker.server import Worker

PROG = "pdserve worker"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not usage + error: launchers show it verbatim.
        self.exit(2, f"{PROG}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The worker's flags."""
    p = _Parser(prog=PROG, description="one pdserve worker: HTTP control API + KV endpoint")
    p.add_argument("--role", choices=ROLES, default="both")
    p.add_argument("--model", default=None, help="Hugging Face folder (default: tiny built-in)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="HTTP port; 0 picks a free one")
    p.add_argument("--kv-port", type=int, default=0, help="KV transfer port; 0 picks one")
    p.add_argument("--worker-id", default="", help="default: <role>-<pid>")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--quantization", choices=("none", "int8"), default="none")
    add_engine_flags(p)
    add_config_flag(p)
    p.add_argument("--ready-file", type=Path, default=None, help='write {"url","pid"} here')
    p.add_argument(
        "--transfer-chunk-timeout-s",
        type=float,
        default=2.0,
        help="deadline of each KV chunk send and reply (a stalled link is noticed this fast)",
    )
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="SPEC",
        help="tests only: inject SITE:ACTION[:key=value,...] (repeatable)",
    )
    p.add_argument("--fault-seed", type=int, default=0, help="seed of the fault plan's draws")
    p.add_argument(
        "--enable-fault-admin", action="store_true", help="tests only: serve /admin/faults"
    )
    p.add_argument(
        "--timeline-ring",
        type=int,
        default=1000,
        help="recent requests whose timeline events /debug/requests/{id} keeps",
    )
    kv = p.add_argument_group("KV transfer")
    kv.add_argument(
        "--kv-transport",
        choices=KV_TRANSPORTS,
        default="auto",
        help="auto: NIXL when installed, shared memory on one host, else TCP (fallbacks are"
        " logged and counted); an explicit one is required of both sides",
    )
    kv.add_argument(
        "--kv-frame-bytes",
        type=int,
        default=4 << 20,
        help="KV data per frame; a larger block travels as several frames",
    )
    kv.add_argument(
        "--kv-canary",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check received KV by value before the first token (and send the digest)",
    )
    kv.add_argument(
        "--kv-handshake-timeout-s",
        type=float,
        default=5.0,
        help="a KV connection must say Hello within this",
    )
    kv.add_argument(
        "--kv-max-connections", type=int, default=64, help="KV connections served at once"
    )
    kv.add_argument(
        "--checkpoint-capacity-mb",
        type=int,
        default=256,
        help="host memory lent to other decode workers' checkpoints (decode roles; 0: none)",
    )
    kv.add_argument(
        "--checkpoint-canary",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="send a value digest with every checkpoint put (one extra one-token forward per"
        " put) and resume only from checkpoints checked by value",
    )
    kv.add_argument(
        "--checkpoint-small-put-kib",
        type=int,
        default=2048,
        help="with --kv-transport auto, checkpoint puts of at most this many KiB go over TCP"
        " (cheaper per message than shm or NIXL); 0: the handoffs' transport",
    )
    kv.add_argument(
        "--checkpoint-links",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send checkpoint puts that go over TCP on one long-lived link per holder (one"
        " frame and one reply per put); --no-checkpoint-links: an HTTP call and a transfer"
        " session per put",
    )
    sec = p.add_argument_group("security and admission")
    sec.add_argument(
        "--cluster-secret-file",
        type=Path,
        default=None,
        help="the cluster secret (else $PDSERVE_CLUSTER_SECRET); every control call and KV"
        " connection must prove it",
    )
    sec.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve without a cluster secret (anyone who reaches the ports may call them)",
    )
    sec.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="requests waiting in the engine before new ones get 503 + Retry-After",
    )
    m = p.add_argument_group("membership (several machines)")
    m.add_argument(
        "--discovery",
        default=None,
        metavar="etcd://HOST:PORT[/PREFIX]",
        help="register in etcd under a lease, for routers started with the same --discovery",
    )
    m.add_argument(
        "--advertise-host", default=None, help="host others reach this worker at (default: --host)"
    )
    m.add_argument(
        "--membership-ttl-s",
        type=int,
        default=10,
        help="lease TTL: a dead worker leaves the routers' pools within this",
    )
    return p


def _default_worker_id(args: argparse.Namespace) -> str:
    if args.discovery is None:
        return f"{args.role}-{os.getpid()}"
    # Registered ids are cluster-wide keys: pids alone repeat across machines.
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())
    return f"{args.role}-{host}-{os.getpid()}"


def build_config(args: argparse.Namespace) -> WorkerConfig:
    """The typed config from parsed flags; ConfigError names a bad value."""
    model = ModelLoadConfig(
        path=args.model,
        dtype=args.dtype,
        quantization=None if args.quantization == "none" else args.quantization,
        device=args.device,
    )
    engine = engine_config(
        args,
        model,
        # A worker that sends handoffs keeps its KV where a same-host receiver can read it
        # (one copy over shared memory instead of two); see `transfer/arena.py`.
        shared_kv=args.role in ("prefill", "both") and args.kv_transport in ("auto", "shm"),
    )
    secret = load_secret(args.cluster_secret_file)
    return WorkerConfig(
        cluster_secret=secret,
        insecure_no_auth=args.insecure_no_auth,
        kv_transport=args.kv_transport,
        kv_frame_bytes=args.kv_frame_bytes,
        kv_canary=args.kv_canary,
        kv_handshake_timeout_s=args.kv_handshake_timeout_s,
        kv_max_connections=args.kv_max_connections,
        checkpoint_capacity_mb=args.checkpoint_capacity_mb,
        checkpoint_canary=args.checkpoint_canary,
        checkpoint_small_put_kib=args.checkpoint_small_put_kib,
        checkpoint_links=args.checkpoint_links,
        max_waiting=args.max_waiting,
        role=args.role,
        host=args.host,
        port=args.port,
        kv_port=args.kv_port,
        worker_id=args.worker_id or _default_worker_id(args),
        ready_file=args.ready_file,
        transfer_chunk_timeout_s=args.transfer_chunk_timeout_s,
        faults=tuple(args.fault),
        fault_seed=args.fault_seed,
        enable_fault_admin=args.enable_fault_admin,
        discovery=args.discovery,
        advertise_host=args.advertise_host,
        membership_ttl_s=args.membership_ttl_s,
        timeline_ring=args.timeline_ring,
        engine=engine,
    )


async def serve(config: WorkerConfig) -> None:
    """Run a worker until SIGTERM/SIGINT, then stop it."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    worker = Worker(config)
    try:
        url = await worker.start()
        logging.getLogger(__name__).info("worker %s (%s) at %s", config.worker_id, config.role, url)
        await stopping.wait()
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
