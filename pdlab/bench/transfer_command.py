"""`pdserve bench transfer [--json FILE]`: flags, the two parts, the printed report, the JSON.

Part `kv` (`transfer_bench`): KV handoffs per transport between two processes against memcpy
and a raw socket, with the checksum's share. Part `handoff` (`handoff_overhead`): TTFT of single
requests disaggregated minus colocated on real local clusters, next to their KV's transfer
time. `--parts` picks them (both by default). A bad flag exits 2 naming it (ConfigError); a
transport or request that fails makes the exit status 1 after the report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from pdlab.bench.handoff_overhead import (
    HandoffBenchError,
    HandoffConfig,
    run_handoff_overhead,
)
from pdlab.bench.handoff_stats import render as render_handoff
from pdlab.bench.handoff_stats import summary_json
from pdlab.bench.transfer import TransferBenchConfig, measure
from pdlab.bench.transfer_stats import LayoutSpec, render_table, report_json
from pdserve.config_file import add_config_flag
from pdserve.errors import ConfigError
from pdserve.settings import add_fields, build

PARTS = ("kv", "handoff")


def parts_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The parts to run, in order; ConfigError naming --parts."""
    parts = tuple(p.strip() for p in args.parts.split(","))
    if not parts or any(p not in PARTS for p in parts) or len(set(parts)) != len(parts):
        raise ConfigError(f"--parts: expected names from {','.join(PARTS)}, got {args.parts!r}")
    return tuple(p for p in PARTS if p in parts)


def config_from_args(args: argparse.Namespace) -> TransferBenchConfig:
    """The validated config of the `kv` part; ConfigError naming the bad flag."""
    try:
        layout = build(LayoutSpec, args)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"--dtype: {exc}") from None
    return build(TransferBenchConfig, args, layout=layout)


def handoff_config_from_args(args: argparse.Namespace) -> HandoffConfig:
    """The validated config of the `handoff` part; ConfigError naming the bad flag."""
    return build(HandoffConfig, args)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's flags, declared on the configs of its parts (their values are checked
    when the configs are built, one line naming the flag); --parts and --json pick what runs
    and where the results go."""
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated, from kv,handoff")
    add_fields(p, TransferBenchConfig, skip=("frame_bytes",))
    add_fields(p, LayoutSpec)
    add_fields(p, TransferBenchConfig, only=("frame_bytes",))
    add_fields(p, HandoffConfig)
    p.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="also write the results here"
    )
    add_config_flag(p)


def run_transfer_bench(args: argparse.Namespace) -> int:
    """The command: run the parts, print each, write the JSON; 1 if anything failed."""
    parts = parts_from_args(args)
    config = config_from_args(args) if "kv" in parts else None
    handoff = handoff_config_from_args(args) if "handoff" in parts else None
    doc: dict[str, object] = {}
    status = 0
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-transfer-") as workdir:
        if config is not None:
            report = asyncio.run(measure(config, Path(workdir)))
            print(render_table(report), flush=True)
            doc.update(report_json(report))
            status |= 1 if report.failed else 0
        if handoff is not None:
            try:
                summary = run_handoff_overhead(handoff, Path(workdir))
            except HandoffBenchError as exc:
                # Reported, and the other part's results are still written.
                print(f"handoff overhead: FAILED: {exc}", flush=True)
                doc["handoff_overhead"] = {"error": str(exc)}
                status = 1
            else:
                print(render_handoff(summary), flush=True)
                doc["ttft_overhead_s"] = summary.ttft_overhead_s
                doc["handoff_transfer_s"] = summary.transfer_s
                doc["handoff_overhead"] = summary_json(summary)
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2))
    return status
