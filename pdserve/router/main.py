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

from pdserve.errors import PdserveError
from pdserve.router.app import create_app
from pdserve.router.config import (
    MODES,
    RECOVERY_STEPS,
    ROUTINGS,
    AffinityConfig,
    BreakerConfig,
    RecoveryConfig,
    RouterConfig,
    parse_mode,
    parse_recovery,
)

_BREAKER = BreakerConfig()
_RECOVERY = RecoveryConfig()
_AFFINITY = AffinityConfig()


def build_parser() -> argparse.ArgumentParser:
    """The router's command-line flags."""
    p = argparse.ArgumentParser(prog="pdserve router", description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="append", default=[], help="worker base URL (repeatable)")
    p.add_argument(
        "--discovery",
        default=None,
        metavar="etcd://HOST:PORT[/PREFIX]",
        help="find workers registered in etcd instead of --worker URLs",
    )
    p.add_argument("--mode", choices=MODES, default="disagg")
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
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="per-request deadline")
    p.add_argument(
        "--lease-ttl-s", type=float, default=30.0, help="decode reservation / prefill KV lease"
    )
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
    return p


def config_from_args(argv: Sequence[str] | None = None) -> RouterConfig:
    """Parse flags into a validated RouterConfig."""
    args = build_parser().parse_args(argv)
    if args.model is None:
        from pdserve.model.tiny import default_model_path

        model = default_model_path()
    else:
        model = Path(args.model)
    return RouterConfig(
        workers=tuple(args.worker),
        discovery=args.discovery,
        faults=tuple(args.fault),
        fault_seed=args.fault_seed,
        model=model,
        mode=parse_mode(args.mode),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        ready_file=args.ready_file,
        request_timeout_s=args.request_timeout_s,
        lease_ttl_s=args.lease_ttl_s,
        timeline_ring=args.timeline_ring,
        health_deadline_s=args.health_deadline_s,
        breaker=BreakerConfig(
            enabled=not args.no_breaker,
            window=args.breaker_window,
            min_samples=args.breaker_min_samples,
            failure_rate=args.breaker_failure_rate,
            cooldown_s=args.breaker_cooldown_s,
        ),
        affinity=AffinityConfig(
            routing=args.routing,
            prefix_weight=args.prefix_weight,
            load_weight=args.load_weight,
            local_prefill_threshold=args.local_prefill_threshold,
            max_sessions=args.max_sessions,
        ),
        recovery=RecoveryConfig(
            steps=parse_recovery(args.recovery),
            transfer_attempts=args.transfer_attempts,
            max_reprefills=args.max_reprefills,
            max_migrations=args.max_migrations,
            queue_timeout_s=args.queue_timeout_s,
            max_queued=args.max_queued,
        ),
    )


def write_ready_file(path: Path, url: str) -> None:
    """Write {"url", "pid"} to `path` atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid()}))
    os.replace(tmp, path)


async def serve(config: RouterConfig) -> None:
    """Run the router until SIGTERM/SIGINT."""
    app = await create_app(config)
    runner = web.AppRunner(app, handle_signals=False)
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
