"""Record the automatic mode's evaluations while the load changes (the curves the unit tests
replay, `tests/unit/router/data/auto_curve_*.json`).

    python benchmarks/record_auto_curve.py OUT.json [--workers N] [--slo-tpot-ms MS]

Starts N `both` workers of the tiny model and a router with `--mode auto` and fast hysteresis
(`pdserve up --mode auto`), then drives three Poisson phases: short prompts at 4 req/s for 8 s,
prompts of 900-1200 tokens with 16-32 output tokens at 4 req/s for 20 s, short prompts at
1 req/s for 20 s. Every 2 s it prints the router's layout and last decision; at the end it
writes `GET /admin/auto` (every evaluation: the live figures, the workers' busy time per
phase, the decision) with the router flags to OUT.json, and stops every process by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.advise.goodput import Endpoint, run_rate
from pdserve.advise.goodput_stats import SLO, WorkloadShape, build_workload, summarize
from pdserve.supervise.launcher import Cluster, UpConfig
from pdserve.supervise.process import exit_on_sigterm

PHASES = (
    (4.0, WorkloadShape(32, 64, 16, 32), 8.0),
    (4.0, WorkloadShape(900, 1200, 16, 32), 20.0),
    (1.0, WorkloadShape(32, 64, 16, 32), 20.0),
)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


async def _drive(router_url: str, slo: SLO) -> None:
    async with aiohttp.ClientSession() as session:
        endpoint = Endpoint("auto", router_url, "tiny-v2")
        for phase, (rate, shape, duration_s) in enumerate(PHASES):
            specs = build_workload(rate, phase, shape, None, duration_s)
            task = asyncio.create_task(run_rate(session, endpoint, specs, 120.0))
            while not task.done():
                await asyncio.sleep(2.0)
                auto = _get(f"{router_url}/health")["auto"]
                print(
                    f"phase {phase}: {auto['num_prefill']} prefill / {auto['num_decode']} decode"
                    f"  {auto['last_action']} ({auto['last_reason']}): {auto['last_detail']}",
                    flush=True,
                )
            records, span_s = await task
            s = summarize("auto", rate, records, span_s, slo)
            print(
                f"phase {phase} done: {s.num_requests} requests, {s.num_errors} errors,"
                f" attainment {s.attainment:.2f}, goodput {s.goodput_rps:.2f}/s",
                flush=True,
            )


def main() -> int:
    exit_on_sigterm()  # a SIGTERM stops the clusters it started (their finally blocks)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--slo-tpot-ms", type=float, default=10.0)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    router_args = (
        "--slo-tpot-ms", f"{args.slo_tpot_ms:g}",
        "--slo-ttft-ms", "2000",
        "--local-prefill-threshold", "0",
        "--auto-window-s", "6",
        "--auto-min-dwell-s", "5",
        "--auto-sustain", "2",
        "--auto-min-requests", "5",
    )  # fmt: skip
    up = UpConfig(
        num_prefill=0,
        num_decode=args.workers,
        mode="auto",
        port=0,
        router_args=router_args,
        state_file=Path(tempfile.mkdtemp()) / "up.json",
    )
    cluster = Cluster(up)
    try:
        url = cluster.start()
        asyncio.run(_drive(url, SLO(2.0, args.slo_tpot_ms / 1e3)))
        evaluations = _get(f"{url}/admin/auto")["evaluations"]
    finally:
        cluster.stop()
    doc = {
        "num_workers": args.workers,
        "router_args": list(router_args),
        "evaluations": evaluations,
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    changes = [
        (e["action"], e["reason"], e["num_prefill"]) for e in evaluations if e["action"] != "keep"
    ]
    print(f"{len(evaluations)} evaluations written to {args.out}; changes: {changes}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
