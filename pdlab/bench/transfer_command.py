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
from pdlab.bench.transfer_stats import TARGETS, LayoutSpec, render_table, report_json
from pdserve.errors import ConfigError
from pdserve.transfer.codec import MAX_DATA_BYTES

PARTS = ("kv", "handoff")


def _ints(flag: str, text: str, low: int) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(
            f"{flag}: expected comma-separated integers >= {low}, got {text!r}"
        ) from None
    if not values or min(values) < low:
        raise ConfigError(f"{flag}: expected comma-separated integers >= {low}, got {text!r}")
    return values


def _one_int(flag: str, text: str, low: int) -> int:
    values = _ints(flag, text, low)
    if len(values) != 1:
        raise ConfigError(f"{flag}: expected one integer >= {low}, got {text!r}")
    return values[0]


def parts_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The parts to run, in order; ConfigError naming --parts."""
    parts = tuple(p.strip() for p in args.parts.split(","))
    if not parts or any(p not in PARTS for p in parts) or len(set(parts)) != len(parts):
        raise ConfigError(f"--parts: expected names from {','.join(PARTS)}, got {args.parts!r}")
    return tuple(p for p in PARTS if p in parts)


def config_from_args(args: argparse.Namespace) -> TransferBenchConfig:
    """The validated config of the `kv` part; ConfigError naming the bad flag."""
    sizes = tuple(sorted(set(_ints("--sizes-kib", args.sizes_kib, 1))))
    transports = tuple(t.strip() for t in args.transports.split(","))
    if any(t not in TARGETS for t in transports) or len(set(transports)) != len(transports):
        raise ConfigError(
            f"--transports: expected distinct names from {','.join(TARGETS)}, got "
            f"{args.transports!r}"
        )
    try:
        layout = LayoutSpec(
            _one_int("--layers", args.layers, 1),
            _one_int("--kv-heads", args.kv_heads, 1),
            _one_int("--head-dim", args.head_dim, 1),
            args.dtype,
            _one_int("--block-size", args.block_size, 1),
        )
    except ValueError as exc:
        raise ConfigError(f"--dtype: {exc}") from None
    frame_kib = _one_int("--frame-kib", args.frame_kib, 1)
    if frame_kib * 1024 > MAX_DATA_BYTES:
        raise ConfigError(f"--frame-kib: at most {MAX_DATA_BYTES // 1024}, got {frame_kib}")
    return TransferBenchConfig(
        sizes=tuple(k * 1024 for k in sizes),
        transports=transports,
        num_runs=_one_int("--runs", args.runs, 1),
        num_warmup=_one_int("--warmup", args.warmup, 0),
        layout=layout,
        frame_bytes=frame_kib * 1024,
    )


def handoff_config_from_args(args: argparse.Namespace) -> HandoffConfig:
    """The validated config of the `handoff` part; ConfigError naming the bad flag."""
    return HandoffConfig(
        num_requests=_one_int("--handoff-requests", args.handoff_requests, 1),
        num_warmup=_one_int("--handoff-warmup", args.handoff_warmup, 0),
        prompt_tokens=_one_int("--handoff-prompt-tokens", args.handoff_prompt_tokens, 1),
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's flags; values are checked when parsed into config (one line naming the
    flag)."""
    d = TransferBenchConfig()
    h = HandoffConfig()
    spec = d.layout
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated, from kv,handoff")
    p.add_argument(
        "--sizes-kib",
        default=",".join(str(n // 1024) for n in d.sizes),
        help="KV sizes per handoff in KiB, comma-separated (whole blocks)",
    )
    p.add_argument(
        "--transports", default=",".join(d.transports), help="comma-separated, from tcp,shm,nixl"
    )
    p.add_argument("--runs", default=str(d.num_runs), help="timed runs per cell (median counts)")
    p.add_argument("--warmup", default=str(d.num_warmup), help="untimed runs before them")
    p.add_argument("--layers", default=str(spec.num_layers), help="KV layout: layers")
    p.add_argument("--kv-heads", default=str(spec.num_kv_heads), help="KV layout: KV heads")
    p.add_argument("--head-dim", default=str(spec.head_dim), help="KV layout: head dim")
    p.add_argument("--dtype", default=spec.dtype, help="KV layout: float32 or bfloat16")
    p.add_argument("--block-size", default=str(spec.block_size), help="tokens per KV block")
    p.add_argument(
        "--frame-kib", default=str(d.frame_bytes // 1024), help="KV data per Chunk frame (KiB)"
    )
    p.add_argument(
        "--handoff-requests",
        default=str(h.num_requests),
        help="measured single requests per mode in the handoff part",
    )
    p.add_argument(
        "--handoff-warmup", default=str(h.num_warmup), help="warm-up requests per mode before them"
    )
    p.add_argument(
        "--handoff-prompt-tokens",
        default=str(h.prompt_tokens),
        help="prompt length of the handoff part (128 KiB of KV per token)",
    )
    p.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="also write the results here"
    )


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
