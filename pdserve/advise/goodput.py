"""`pdserve bench serve`: Poisson load at several rates, goodput under TTFT and TPOT SLOs, per mode.

Each mode gets its own local cluster (`launcher.Cluster`, stopped by PID at the end) with the
same number of worker processes, so the comparison is of how two workers are used, not of
how many there are:
- `disagg`: 1 prefill + 1 decode (role both) worker, router `--mode disagg` with local
  prefill off, so every request is prefilled on one worker and its KV travels to the other;
- `colocated`: 2 `both` workers, router `--mode colocated`: each request runs whole on one.
Every worker is limited to one intra-op thread (inherited OMP/MKL settings), so on a small
machine neither shape gets more cores than the other.

Run: every cluster starts and serves one warm-up request; then, rate by rate, each mode serves
the same seeded workload (`serve_stats.build_workload`; rate i uses seed + i, so no rate finds
another's prompts in a prefix cache), the modes taking turns and the first one rotating per
rate, so drifting background load hits them alike. A rate's run sends each request at its
Poisson arrival time and waits for every stream to end. With `--plot`, the median-latency
request of each mode at the highest rate has its merged timeline fetched from
`GET /debug/requests/{id}` before its cluster stops. The arithmetic lives in `serve_stats`,
the drawing in `serve_plot`.

`measure` (warm-up, rates in turn, arms rotated, records and summaries) and `run_rate` (one
rate's Poisson run) are shared with `pdserve advise`, whose arms are one cluster switched
between colocated and each P:D split (`Endpoint.prepare`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import tempfile
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from pdserve.advise import flags
from pdserve.advise.client import stream_completion
from pdserve.advise.goodput_stats import (
    SLO,
    RateSummary,
    RequestRecord,
    RequestSpec,
    WorkloadShape,
    build_workload,
    goodput_ratios,
    render_table,
    representative,
    summarize,
)
from pdserve.config import MODEL
from pdserve.config_file import add_config_flag
from pdserve.errors import ConfigError
from pdserve.observability.trace import TraceError, fetch_timeline
from pdserve.settings import add_fields, build, setting
from pdserve.supervise.launcher import Cluster, UpConfig


@dataclass(frozen=True, slots=True)
class ModeShape:
    """The cluster one mode runs on."""

    num_prefill: int
    num_decode: int
    router_args: tuple[str, ...] = ()


# Two worker processes each (see the module docstring).
MODES: dict[str, ModeShape] = {
    "disagg": ModeShape(1, 1, ("--local-prefill-threshold", "0")),
    "colocated": ModeShape(0, 2),
}


def _modes(flag: str, text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(","))
    unknown = [m for m in modes if m not in MODES]
    if unknown or len(set(modes)) != len(modes):
        raise ConfigError(f"{flag}: expected distinct names from {','.join(MODES)}, got {text!r}")
    return modes


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """What `pdserve bench serve` runs (defaults: ~2 minutes with the tiny model on 2 cores)."""

    rates: tuple[float, ...] = (2.0, 4.0, 8.0, 16.0)
    # Exactly one of the two: requests per rate, or seconds of arrivals per rate.
    num_requests: int | None = None
    duration_s: float | None = 10.0
    modes: tuple[str, ...] = flags.checked(
        tuple(MODES), _modes, help="comma-separated, from disagg,colocated"
    )
    slo: SLO = field(default_factory=lambda: SLO(ttft_s=0.25, tpot_s=0.025))
    shape: WorkloadShape = field(default_factory=WorkloadShape)
    seed: int = flags.checked(
        0, lambda flag, text: flags.integer(flag, text, 0), help="seed of arrivals and prompts"
    )
    model: str | None = setting(None, MODEL)
    json_path: Path | None = setting(None, flags.JSON_FILE)
    plot_dir: Path | None = setting(
        None,
        flags.PLOT_DIR,
        help="write PNGs here: goodput/attainment vs rate, latency CDFs, one request's phases"
        " (needs pdserve[plot])",
    )
    # Per request: a stream still open after this is an error, not a hang of the benchmark.
    request_timeout_s: float = 120.0


@dataclass(slots=True)
class ServeReport:
    """Everything one run measured."""

    summaries: list[RateSummary] = field(default_factory=list)
    # (mode, rate) → that run's requests.
    records: dict[tuple[str, float], list[RequestRecord]] = field(default_factory=dict)
    # mode → the merged /debug/requests view of its representative request (with --plot).
    timelines: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A started cluster (or one arm of it) as the load generator sees it."""

    # The name its rows carry in reports (a mode, or an advise arm such as "disagg-1:1").
    mode: str
    router_url: str
    model_name: str
    # Awaited before each of this endpoint's runs (advise switches the router's roles here).
    prepare: Callable[[aiohttp.ClientSession], Awaitable[None]] | None = None


# The requests of one run (rate index, rate, endpoint, repeat index), and the warm-up of one
# endpoint.
WorkloadFn = Callable[[int, float, Endpoint, int], list[RequestSpec]]
WarmupFn = Callable[[Endpoint], list[RequestSpec]]


def _body(spec: RequestSpec, model_name: str) -> dict[str, object]:
    # Greedy with ignore_eos: every request yields exactly max_tokens, in every mode.
    return {
        "model": model_name,
        "prompt": list(spec.prompt_token_ids),
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


async def run_rate(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    specs: list[RequestSpec],
    timeout_s: float,
) -> tuple[list[RequestRecord], float]:
    """Send each request at its arrival time; (records, span from first send to last end)."""
    loop = asyncio.get_running_loop()
    origin = loop.time()

    async def one(spec: RequestSpec) -> RequestRecord:
        await asyncio.sleep(max(0.0, origin + spec.arrival_s - loop.time()))
        body = _body(spec, endpoint.model_name)
        c = await stream_completion(session, endpoint.router_url, body, timeout_s=timeout_s)
        error = c.error
        if error is None and len(c.token_ids) != spec.max_tokens:
            error = f"short_stream: {len(c.token_ids)} tokens, want {spec.max_tokens}"
        return RequestRecord(
            spec.index,
            len(spec.prompt_token_ids),
            len(c.token_ids),
            c.ttft_s,
            c.latency_s,
            error,
            c.request_id,
        )

    records = list(await asyncio.gather(*(one(s) for s in specs)))
    span_s = loop.time() - (origin + specs[0].arrival_s)
    return records, span_s


def default_warmup(endpoint: Endpoint) -> list[RequestSpec]:
    """One short request: the first request of a cluster pays one-off costs."""
    return [RequestSpec(-1, 0.0, tuple(range(100, 164)), 8)]


class RunSettings(Protocol):
    """What `measure` reads of a command's config (`ServeConfig`, `AdviseConfig`)."""

    @property
    def rates(self) -> tuple[float, ...]: ...
    @property
    def slo(self) -> SLO: ...
    @property
    def request_timeout_s(self) -> float: ...
    @property
    def plot_dir(self) -> Path | None: ...


async def measure(
    endpoints: Sequence[Endpoint],
    config: RunSettings,
    workload: WorkloadFn,
    warmup: WarmupFn = default_warmup,
    repeats: int = 1,
) -> ServeReport:
    """Warm every endpoint up, then rate by rate run each endpoint's workload, the endpoints
    taking turns with the first one rotating per rate and repeat; summaries in endpoint then
    rate order. With `repeats` > 1 each rate is run that many times per endpoint, alternating
    (A B B A ...), and summarised over all of them (goodput over the sum of the spans): a
    background load that drifts during the run then hits every endpoint alike. With
    a `plot_dir`, the median-latency request of each endpoint at the highest rate has its
    merged timeline fetched."""
    rates, slo, request_timeout_s = config.rates, config.slo, config.request_timeout_s
    timelines = config.plot_dir is not None
    report = ServeReport()
    top_rate = max(rates)
    async with aiohttp.ClientSession() as session:
        for e in endpoints:
            if e.prepare is not None:
                await e.prepare(session)
            await run_rate(session, e, warmup(e), request_timeout_s)
        for i, rate in enumerate(rates):
            spans: dict[str, float] = {}
            for rep in range(repeats):
                shift = (i + rep) % len(endpoints)
                for e in [*endpoints[shift:], *endpoints[:shift]]:
                    if e.prepare is not None:
                        await e.prepare(session)
                    specs = workload(i, rate, e, rep)
                    records, span_s = await run_rate(session, e, specs, request_timeout_s)
                    report.records.setdefault((e.mode, rate), []).extend(records)
                    spans[e.mode] = spans.get(e.mode, 0.0) + span_s
            for e in endpoints:
                records = report.records[(e.mode, rate)]
                report.summaries.append(summarize(e.mode, rate, records, spans[e.mode], slo))
                chosen = representative(records)
                if timelines and rate == top_rate and chosen is not None:
                    report.timelines[e.mode] = await asyncio.to_thread(
                        _fetch_view, e.router_url, chosen.request_id
                    )
    order = {e.mode: k for k, e in enumerate(endpoints)}
    report.summaries.sort(key=lambda s: (order[s.mode], s.rate))
    return report


async def _measure(config: ServeConfig, endpoints: list[Endpoint]) -> ServeReport:
    def workload(i: int, rate: float, endpoint: Endpoint, repeat: int) -> list[RequestSpec]:
        # The same seeded requests for every mode (seed + i: no rate finds another's prompts).
        return build_workload(
            rate, config.seed + i, config.shape, config.num_requests, config.duration_s
        )

    return await measure(endpoints, config, workload)


def _fetch_view(router_url: str, request_id: str | None) -> dict[str, Any]:
    if request_id is None:
        return {}
    try:
        return fetch_timeline(router_url, request_id, timeout_s=10.0, workers=True)
    except TraceError:
        return {}  # evicted or unanswered: the report just lacks that plot


def run_serve(config: ServeConfig) -> ServeReport:
    """Start one cluster per mode, measure every rate, stop every cluster by PID."""
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-bench-serve-"))
    started: list[Cluster] = []
    try:
        endpoints = []
        for mode in config.modes:
            shape = MODES[mode]
            up = UpConfig(
                num_prefill=shape.num_prefill,
                num_decode=shape.num_decode,
                mode=mode,
                model=config.model,
                port=0,
                router_args=shape.router_args,
                # Not the default file: a running `pdserve up` stays what `status` finds.
                state_file=workdir / f"{mode}.json",
            )
            cluster = Cluster(up)
            started.append(cluster)
            router_url = cluster.start()
            with urllib.request.urlopen(f"{router_url}/health", timeout=10) as resp:
                model_name = str(json.loads(resp.read())["model"])
            endpoints.append(Endpoint(mode, router_url, model_name))
        return asyncio.run(_measure(config, endpoints))
    finally:
        for cluster in started:
            cluster.stop()


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def rows_json(report: ServeReport, label: str = "mode") -> dict[str, list[dict[str, object]]]:
    """A report's summaries (`results`, NaN as null) and every request (`requests`, keyed by
    `label`: "mode" here, "arm" in `pdserve advise`) for a `--json` document."""
    return {
        "results": [
            {k: _finite(v) if isinstance(v, float) else v for k, v in asdict(s).items()}
            for s in report.summaries
        ],
        "requests": [
            {label: name, "rate": rate, **asdict(r), "tpot_s": r.tpot_s}
            for (name, rate), records in report.records.items()
            for r in records
        ],
    }


def prepare_run(plot_dir: Path | None) -> None:
    """Before a benchmark starts anything: a missing plot extra fails now, not after minutes
    of measuring; worker processes get one intra-op thread each (they share the cores)."""
    if plot_dir is not None:
        from pdserve.observability.plot import load_pyplot

        load_pyplot()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")


def report_json(config: ServeConfig, report: ServeReport) -> dict[str, object]:
    """The `--json` document: config, one summary per (mode, rate), ratios, every request."""
    rows = rows_json(report)
    return {
        "config": {
            "rates": list(config.rates),
            "num_requests": config.num_requests,
            "duration_s": config.duration_s,
            "modes": list(config.modes),
            "ttft_slo_ms": config.slo.ttft_s * 1e3,
            "tpot_slo_ms": config.slo.tpot_s * 1e3,
            "shape": asdict(config.shape),
            "seed": config.seed,
            "clusters": {m: asdict(MODES[m]) for m in config.modes},
        },
        "results": rows["results"],
        "goodput_ratio_disagg_over_colocated": {
            str(rate): ratio for rate, ratio in goodput_ratios(report.summaries).items()
        },
        "requests": rows["requests"],
    }


def run_serve_bench(args: argparse.Namespace) -> int:
    """The `pdserve bench serve` command."""
    config = config_from_args(args)
    prepare_run(config.plot_dir)
    report = run_serve(config)
    print(render_table(report.summaries, config.slo))
    print()
    for rate, ratio in goodput_ratios(report.summaries).items():
        shown = "n/a (colocated goodput 0)" if ratio is None else f"{ratio:.2f}x"
        print(f"goodput at {rate:g} req/s: disagg / colocated = {shown}")
    if config.json_path is not None:
        config.json_path.write_text(json.dumps(report_json(config, report), indent=2))
    if config.plot_dir is not None:
        from pdserve.advise.goodput_plot import save_serve_plots

        for path in save_serve_plots(report, config.slo, config.plot_dir):
            print(f"plot written to {path}")
    return 0


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The validated config; a bad value raises ConfigError naming its flag."""
    d = ServeConfig()
    load = flags.parse_load(args, d.duration_s or 10.0)
    ttft_ms = flags.positive("--ttft-slo-ms", args.ttft_slo_ms) or 0.0
    tpot_ms = flags.positive("--tpot-slo-ms", args.tpot_slo_ms) or 0.0
    return build(
        ServeConfig,
        args,
        rates=load.rates,
        num_requests=load.num_requests,
        duration_s=load.duration_s,
        slo=SLO(ttft_s=ttft_ms / 1e3, tpot_s=tpot_ms / 1e3),
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's flags, most declared on `ServeConfig`; the load and the SLOs, each made
    of several flags checked together, here (`config_from_args`: one line naming the flag)."""
    d = ServeConfig()
    flags.add_load_arguments(p, d.rates, d.duration_s or 10.0, "rate")
    add_fields(p, ServeConfig, only=("modes",))
    p.add_argument(
        "--ttft-slo-ms", default=f"{d.slo.ttft_s * 1e3:g}", help="time to first token SLO"
    )
    p.add_argument(
        "--tpot-slo-ms", default=f"{d.slo.tpot_s * 1e3:g}", help="time per output token SLO"
    )
    add_fields(p, ServeConfig, only=("seed", "model", "json_path", "plot_dir"))
    add_config_flag(p)
