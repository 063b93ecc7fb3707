"""`pdserve advise`: should this workload run colocated or split, and at which P:D ratio?

It measures instead of guessing: one local cluster of N `both` workers and a router, and for
every arm (`advise_report.arms_for`: colocated, then each P:D split of the N workers) the
goodput curve of the user's workload (`advise_workload`: length ranges or a JSONL trace) under
the user's TTFT and TPOT SLOs. The arms share the workers: before each run the router is
switched with `POST /admin/mode` (`{"mode": "colocated"}`, or `{"mode": "disagg",
"num_prefill": P}`, which gives P of the `both` workers the prefill role, `router/mode/roles.py`),
so every arm runs on the same processes with the same warm state. Each arm is warmed up the same
way (two requests of the workload's largest shape), then rate by rate each arm serves the same
seeded arrivals and lengths (its prompt ids respelled per arm so no arm finds another's prompts
in the prefix cache), the arms taking turns with the first rotating per rate (`serve.measure`).
Local prefill is off (`--local-prefill-threshold 0`) and the breaker too, so a split arm
measures the split. Every process is stopped by PID at the end.

Bad input (SLOs, rates, worker count, length ranges, a malformed trace line) is refused with a
line naming the flag or the line before any process starts. The conclusion is
`advise_report.advise`; the plots are `serve_plot`'s, one curve per arm.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import tempfile
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from pdserve.advise.calibration import Lone, Relative, calibrated, measure_lone, middle, tpot_of
from pdserve.advise.client import stream_completion
from pdserve.advise.flags import (
    JSON_FILE,
    PLOT_DIR,
    add_load_arguments,
    checked,
    integer,
    parse_load,
    positive,
)
from pdserve.advise.goodput import Endpoint, ServeReport, measure, prepare_run, rows_json
from pdserve.advise.goodput_stats import SLO, RequestSpec, WorkloadShape, render_table
from pdserve.advise.report import Advice, Arm, advise, arms_for, render_advice
from pdserve.advise.workload import AdviseWorkload, parse_range, parse_trace, respell
from pdserve.cli.command import run
from pdserve.config import MODEL
from pdserve.config_file import add_config_flag
from pdserve.errors import ConfigError
from pdserve.router.mode.interference import SLOConfig
from pdserve.settings import add_fields, build, setting
from pdserve.supervise.launcher import Cluster, UpConfig

_SLO = SLOConfig()
MAX_WORKERS = 8
MAX_RATE = 1000.0
MAX_SLO_MS = 3_600_000.0
_DEFAULT_RATES = "1,2,4,8"


@dataclass(frozen=True, slots=True)
class AdviseConfig:
    """What `pdserve advise` runs (validated by `config_from_args`)."""

    workload: AdviseWorkload
    num_workers: int = checked(
        2,
        lambda name, text: integer(name, text, 2, MAX_WORKERS),
        name="workers",
        help=f"worker processes (2..{MAX_WORKERS})",
    )
    slo: SLO = field(default_factory=lambda: SLO(_SLO.ttft_s, _SLO.tpot_s))
    rates: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    num_requests: int | None = None
    duration_s: float | None = 10.0
    target_attainment: float = checked(
        0.9,
        lambda name, text: positive(name, text, 1.0),
        help="fraction of requests that must meet both SLOs",
    )
    seed: int = checked(
        0, lambda name, text: integer(name, text, 0), help="seed of arrivals, lengths and prompts"
    )
    model: str | None = setting(None, MODEL)
    # Passed to every worker (None: the engine's default).
    max_num_batched_tokens: int | None = checked(
        None,
        lambda name, text: integer(name, text, 1, 1 << 20),
        help="tokens per engine step (worker flag)",
    )
    # Runs per rate and arm, alternating arms (each --duration-s / --num-requests long).
    repeats: int = checked(
        1,
        lambda name, text: integer(name, text, 1, 100),
        help="runs per rate and arm, arms alternating (evens out a drifting background load)",
    )
    json_path: Path | None = setting(None, JSON_FILE)
    plot_dir: Path | None = setting(
        None,
        PLOT_DIR,
        help="write PNGs here: goodput/attainment vs rate per arm, latency CDFs (pdserve[plot])",
    )
    request_timeout_s: float = 120.0
    # SLOs and rates as multiples of a lone request, measured first (`advise/calibration.py`);
    # None: `slo` and `rates` as given.
    relative: Relative | None = None


@dataclass(slots=True)
class AdviseResult:
    """The measured curves and the conclusion, under the config they ran with (calibrated)."""

    config: AdviseConfig
    arms: list[Arm]
    report: ServeReport
    advice: Advice
    # The lone request the SLOs and rates were calibrated on (None: absolute ones given).
    lone: Lone | None = None


def _endpoints(arms: list[Arm], router_url: str, model_name: str) -> list[Endpoint]:
    endpoints = []
    for arm in arms:
        body: dict[str, object] = (
            {"mode": "disagg", "num_prefill": arm.num_prefill}
            if arm.split
            else {"mode": "colocated"}
        )

        async def prepare(session: aiohttp.ClientSession, body: dict[str, object] = body) -> None:
            async with session.post(f"{router_url}/admin/mode", json=body) as resp:
                if resp.status != 200:
                    raise ConfigError(f"router refused {body}: {resp.status} {await resp.text()}")

        endpoints.append(Endpoint(arm.name, router_url, model_name, prepare))
    return endpoints


def run_advise(config: AdviseConfig) -> AdviseResult:
    """Start the cluster, measure every arm at every rate, stop every process by PID."""
    arms = arms_for(config.num_workers)
    worker_args: tuple[str, ...] = ()
    if config.max_num_batched_tokens is not None:
        worker_args = ("--max-num-batched-tokens", str(config.max_num_batched_tokens))
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-advise-"))
    up = UpConfig(
        num_prefill=0,
        num_decode=config.num_workers,
        mode="colocated",
        model=config.model,
        port=0,
        router_args=(
            "--local-prefill-threshold",
            "0",
            "--no-breaker",
            "--slo-ttft-ms",
            f"{config.slo.ttft_s * 1e3:g}",
            "--slo-tpot-ms",
            f"{config.slo.tpot_s * 1e3:g}",
        ),
        worker_args=worker_args,
        # Not the default file: a running `pdserve up` stays what `status` finds.
        state_file=workdir / "advise.json",
    )
    cluster = Cluster(up)
    try:
        router_url = cluster.start()
        with urllib.request.urlopen(f"{router_url}/health", timeout=10) as resp:
            model_name = str(json.loads(resp.read())["model"])
        endpoints = _endpoints(arms, router_url, model_name)
        lone = None
        if config.relative is not None:
            lone = asyncio.run(_lone(config, config.relative, endpoints[0], router_url, model_name))
            slo, rates = calibrated(lone, config.relative)
            config = dataclasses.replace(config, slo=slo, rates=rates)
        arm_index = {a.name: k for k, a in enumerate(arms)}

        def workload(i: int, rate: float, endpoint: Endpoint, repeat: int) -> list[RequestSpec]:
            seed = (config.seed + i) * 1000 + repeat
            specs = config.workload.build(rate, seed, config.num_requests, config.duration_s)
            # Same arrivals and lengths for every arm, prompt ids of its own (prefix cache).
            return respell(specs, seed * MAX_WORKERS + arm_index[endpoint.mode])

        def warmup(endpoint: Endpoint) -> list[RequestSpec]:
            big = max(
                config.workload.build(1.0, config.seed, 32, None),
                key=lambda s: len(s.prompt_token_ids),
            )
            specs = [
                RequestSpec(-2, 0.0, big.prompt_token_ids, big.max_tokens),
                RequestSpec(-1, 0.0, big.prompt_token_ids, big.max_tokens),
            ]
            return respell(specs, 10_000 + arm_index[endpoint.mode])

        report = asyncio.run(
            measure(endpoints, config, workload, warmup=warmup, repeats=config.repeats)
        )
    finally:
        cluster.stop()
    advice = advise(arms, report.summaries, config.target_attainment)
    return AdviseResult(config, arms, report, advice, lone)


async def _lone(
    config: AdviseConfig, relative: Relative, colocated: Endpoint, router_url: str, model: str
) -> Lone:
    """A lone request of the workload's middle size, colocated, on the cluster just started."""
    specs = config.workload.build(1.0, config.seed, 64, None)
    prompt_len = middle([len(s.prompt_token_ids) for s in specs])
    output_len = middle([s.max_tokens for s in specs])
    rng = random.Random(config.seed)
    async with aiohttp.ClientSession() as session:
        assert colocated.prepare is not None
        await colocated.prepare(session)

        async def send() -> tuple[float, float] | None:
            # A new prompt each time: a cached one would measure the prefix cache.
            prompt = [rng.randrange(40, 2000) for _ in range(prompt_len)]
            body = {"model": model, "prompt": prompt, "max_tokens": output_len,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            got = await stream_completion(session, router_url, body)
            tpot = tpot_of(got.ttft_s, got.latency_s, len(got.token_ids))
            return None if got.error or got.ttft_s is None or tpot is None else (got.ttft_s, tpot)

        return await measure_lone(send, relative.repeats, output_len)


def report_json(result: AdviseResult) -> dict[str, object]:
    """The `--json` document: config, curves, sustained rates, recommendation, ratios."""
    config, advice, report = result.config, result.advice, result.report
    relative = config.relative
    rows = rows_json(report, "arm")
    by_key = {(s.mode, s.rate): s for s in report.summaries}
    per_arm: dict[str, dict[str, float | None]] = {}
    for arm in result.arms:
        if not arm.split:
            continue
        per_arm[arm.name] = {}
        for rate in config.rates:
            top, bottom = by_key.get((arm.name, rate)), by_key.get(("colocated", rate))
            ok = top is not None and bottom is not None and bottom.goodput_rps > 0
            per_arm[arm.name][str(rate)] = top.goodput_rps / bottom.goodput_rps if ok else None  # type: ignore[union-attr]
    return {
        "config": {
            "num_workers": config.num_workers,
            "ttft_slo_ms": config.slo.ttft_s * 1e3,
            "tpot_slo_ms": config.slo.tpot_s * 1e3,
            "target_attainment": config.target_attainment,
            "rates": list(config.rates),
            "num_requests": config.num_requests,
            "duration_s": config.duration_s,
            "seed": config.seed,
            "repeats": config.repeats,
            "model": config.model,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "workload": config.workload.describe(),
            "arms": [a.to_dict() for a in result.arms],
            "calibration": None
            if relative is None or result.lone is None
            else {
                "lone_ttft_ms": result.lone.ttft_s * 1e3,
                "lone_tpot_ms": result.lone.tpot_s * 1e3,
                "lone_output_tokens": result.lone.num_output_tokens,
                "slo_ttft_x": relative.ttft_x,
                "slo_tpot_x": relative.tpot_x,
                "rates_x": list(relative.rates_x),
                "repeats": relative.repeats,
            },
        },
        "results": rows["results"],
        "sustained_rate": advice.sustained,
        "recommendation": {
            **advice.arm.to_dict(),
            "meets_slo": advice.meets_slo,
            "sustained_rate": advice.sustained[advice.arm.name],
        },
        "best_split": None if advice.best_split is None else advice.best_split.name,
        "goodput_ratio_disagg_vs_colocated": {
            str(rate): ratio for rate, ratio in advice.ratio_by_rate.items()
        },
        "goodput_ratio_vs_colocated": per_arm,
        "requests": rows["requests"],
    }


def run_advise_command(args: argparse.Namespace) -> int:
    """The `pdserve advise` command."""
    config = config_from_args(args)
    prepare_run(config.plot_dir)
    result = run_advise(config)
    config = result.config
    if result.lone is not None:
        print(
            f"calibrated on a lone request: TTFT {result.lone.ttft_s * 1e3:.1f} ms, TPOT"
            f" {result.lone.tpot_s * 1e3:.2f} ms -> SLOs {config.slo.ttft_s * 1e3:.0f} /"
            f" {config.slo.tpot_s * 1e3:.1f} ms, rates {', '.join(f'{r:g}' for r in config.rates)}"
        )
    print(render_table(result.report.summaries, config.slo))
    print()
    print(render_advice(result.advice, config.slo, config.target_attainment))
    if config.json_path is not None:
        config.json_path.write_text(json.dumps(report_json(result), indent=2))
        print(f"results written to {config.json_path}")
    if config.plot_dir is not None:
        from pdserve.advise.goodput_plot import save_serve_plots

        for path in save_serve_plots(result.report, config.slo, config.plot_dir):
            print(f"plot written to {path}")
    return 0


def _max_model_len(model: str | None) -> int:
    from pdserve.model.config import load_config

    if model is None:
        from pdserve.model.tiny import default_model_path

        path = default_model_path()
    else:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise ConfigError(f"--model: {model!r} has no config.json")
    return load_config(path).max_position_embeddings


def config_from_args(args: argparse.Namespace) -> AdviseConfig:
    """The validated config; a bad value raises ConfigError naming its flag or trace line."""
    d = AdviseConfig(workload=AdviseWorkload(shape=WorkloadShape()))
    ttft_ms = positive("--slo-ttft-ms", args.slo_ttft_ms, MAX_SLO_MS) or d.slo.ttft_s * 1e3
    tpot_ms = positive("--slo-tpot-ms", args.slo_tpot_ms, MAX_SLO_MS) or d.slo.tpot_s * 1e3
    load = parse_load(args, 10.0, MAX_RATE, 100_000, 3600)
    relative = _relative(args)
    synthetic = args.prompt_tokens is not None or args.output_tokens is not None
    if args.workload is not None and synthetic:
        flag = "--prompt-tokens" if args.prompt_tokens is not None else "--output-tokens"
        raise ConfigError(f"{flag}: give length ranges or --workload FILE, not both")
    max_model_len = _max_model_len(args.model)
    if args.workload is not None:
        path = Path(args.workload)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--workload: cannot read {str(path)!r}: {exc}") from None
        workload = AdviseWorkload(
            trace=tuple(parse_trace(text, max_model_len, f"--workload {path}"))
        )
    else:
        prompt = parse_range("--prompt-tokens", args.prompt_tokens or "32-512", max_model_len - 1)
        output = parse_range("--output-tokens", args.output_tokens or "8-64", max_model_len - 1)
        if prompt[1] + output[1] > max_model_len:
            raise ConfigError(
                f"--output-tokens: longest prompt {prompt[1]} + longest output {output[1]}"
                f" exceed the model's context of {max_model_len} tokens"
            )
        workload = AdviseWorkload(shape=WorkloadShape(*prompt, *output))
    return build(
        AdviseConfig,
        args,
        workload=workload,
        slo=SLO(ttft_s=ttft_ms / 1e3, tpot_s=tpot_ms / 1e3),
        rates=load.rates,
        num_requests=load.num_requests,
        duration_s=load.duration_s,
        relative=relative,
    )


_RELATIVE = ("--slo-ttft-x", "--slo-tpot-x", "--rates-x")


def _relative(args: argparse.Namespace) -> Relative | None:
    """The SLOs and rates as multiples of a lone request, when asked for (all three, and no
    absolute SLO or rate alongside); ConfigError naming the flag otherwise."""
    given = [f for f in _RELATIVE if getattr(args, f[2:].replace("-", "_")) is not None]
    if not given:
        return None
    missing = [f for f in _RELATIVE if f not in given]
    if missing:
        raise ConfigError(f"{missing[0]}: needed with {given[0]} (SLOs and rates relative)")
    for flag, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms)):
        if value is not None:
            raise ConfigError(f"{flag}: give absolute SLOs or {given[0]}, not both")
    if args.rates != _DEFAULT_RATES:
        raise ConfigError("--rates: give absolute rates or --rates-x, not both")
    return build(Relative, args)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's flags, most declared on `AdviseConfig` and `Relative`; the SLOs, the
    workload and the load, each made of several flags checked together, here (values are
    checked by `config_from_args`, one line naming the flag)."""
    d = AdviseConfig(workload=AdviseWorkload(shape=WorkloadShape()))
    add_fields(p, AdviseConfig, only=("num_workers",))
    p.add_argument(
        "--slo-ttft-ms",
        default=None,
        help=f"time to first token SLO (default {d.slo.ttft_s * 1e3:g})",
    )
    p.add_argument(
        "--slo-tpot-ms",
        default=None,
        help=f"time per output token SLO (default {d.slo.tpot_s * 1e3:g})",
    )
    add_fields(p, Relative)
    w = p.add_argument_group("workload (length ranges, or a JSONL trace)")
    w.add_argument(
        "--prompt-tokens", default=None, metavar="N|MIN-MAX", help="prompt lengths (default 32-512)"
    )
    w.add_argument(
        "--output-tokens", default=None, metavar="N|MIN-MAX", help="output lengths (default 8-64)"
    )
    w.add_argument(
        "--workload",
        default=None,
        metavar="FILE",
        help='JSONL, one {"prompt_tokens": N, "output_tokens": M} per line',
    )
    add_load_arguments(p, d.rates, d.duration_s or 10.0, "rate and arm")
    later = ("target_attainment", "seed", "repeats", "max_num_batched_tokens", "model")
    add_fields(p, AdviseConfig, only=(*later, "json_path", "plot_dir"))
    add_config_flag(p)


def build_parser() -> argparse.ArgumentParser:
    """The command's parser."""
    p = argparse.ArgumentParser(prog="pdserve advise", description=__doc__.splitlines()[0])
    add_arguments(p)
    return p


def main(argv: Sequence[str]) -> int:
    """Run the command (it starts a local cluster: SIGTERM stops it by PID)."""
    return run("advise", build_parser(), run_advise_command, argv, stop_on_sigterm=True)
