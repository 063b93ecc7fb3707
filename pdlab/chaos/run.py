"""`pdserve chaos`: run fault scenarios against real local clusters and report what each cost.

One run: a fault-free reference cluster serves the workload once (the reference tokens), then
each scenario gets a fresh cluster of its own shape:

    start → warm-up request → fault-free baseline pass (latencies, side by side)
          → pinned blocks at idle → trigger + the same workload
          → wait one lease TTL → pinned blocks again → stop every process by PID

The workload is the same every time: `num_requests` concurrent, streamed, seeded completions
with `ignore_eos`, so a fault-free run is deterministic and any lost, repeated or different
token shows. Each scenario's figures and missed targets are printed as a table and written as
JSON with `--json`; the exit status is 1 when any target was missed. With `--plot DIR`, the
merged timeline of each scenario's slowest completed request is fetched before its cluster
stops and drawn into DIR/<scenario>.png.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from pdlab.chaos.cluster import ChaosCluster, http_json
from pdlab.chaos.scenarios import (
    LATENCY_SLACK_S,
    LEASE_TTL_S,
    REQUEST_TIMEOUT_S,
    Outcome,
    Scenario,
    ScenarioResult,
    Trigger,
    judge,
    measure_outputs,
    standard_workers,
)
from pdserve.advise.client import Completion, OnTokens, stream_completion
from pdserve.observability import metric_names
from pdserve.observability.exposition import parse as parse_exposition
from pdserve.observability.plot import load_pyplot, save_plot
from pdserve.observability.stats import percentile

log = logging.getLogger(__name__)

PROMPTS = (
    "The quick brown fox jumps over the lazy dog and then",
    "Once upon a time, in a small village by the sea, there lived",
    "In the beginning the engineers split prefill from decode because",
    "A lease is a promise with a deadline: when it lapses,",
    "She opened the old map and traced the river with her finger until",
    "Every token must arrive exactly once, in order, even when",
)
# Seconds past the lease TTL before pinned blocks are read again: the reaper runs every 0.5 s.
_REAP_SLACK_S = 1.5
# Client tokens after which KILL_MID_DECODE kills the decode worker streaming the request.
_KILL_AFTER_TOKENS = 5


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    """What `pdserve chaos` runs."""

    scenarios: tuple[Scenario, ...]
    model: str | None = None
    num_requests: int = 6
    max_tokens: int = 24
    json_path: Path | None = None
    workdir: Path | None = None
    # Hold extra latency to its bound (see `judge`); measured either way.
    strict_latency: bool = True
    # With a folder: each scenario's slowest completed request's merged timeline as a PNG.
    plot_dir: Path | None = None
    # Scenarios run at once, each on its own cluster. More than 1 shortens the run (most of a
    # scenario is waiting: processes starting, a lease TTL running out) but shares the CPU,
    # so extra latency is then only loosely meaningful: pair it with strict_latency=False.
    concurrency: int = 1


def _request_body(index: int, max_tokens: int, model: str) -> dict[str, object]:
    return {
        "model": model,
        "prompt": PROMPTS[index % len(PROMPTS)],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": 1000 + index,
        "ignore_eos": True,
    }


def _outcome(index: int, completion: Completion) -> Outcome:
    return Outcome(
        index,
        tuple(completion.token_ids),
        completion.finish_reason,
        completion.error,
        completion.latency_s,
    )


async def _workload(
    cluster: ChaosCluster,
    indexes: Sequence[int],
    max_tokens: int,
    on_tokens: OnTokens | None = None,
) -> list[tuple[int, Completion]]:
    """Send request `i` for each index at once; (index, completion) however each ended."""
    async with aiohttp.ClientSession() as session:
        completions = list(
            await asyncio.gather(
                *(
                    stream_completion(
                        session,
                        cluster.router_url,
                        _request_body(i, max_tokens, cluster.model_name),
                        on_tokens,
                        timeout_s=REQUEST_TIMEOUT_S + 10,
                    )
                    for i in indexes
                )
            )
        )
    return list(zip(indexes, completions, strict=True))


def _pinned(cluster: ChaosCluster) -> dict[str, int]:
    """Pinned blocks per live worker."""
    found: dict[str, int] = {}
    for name in cluster.workers:
        if cluster.alive(name):
            try:
                found[name] = int(cluster.health(name)["num_pinned_blocks"])  # type: ignore[call-overload]
            except (OSError, urllib.error.URLError):
                continue
    return found


def _timelines(cluster: ChaosCluster, completions: Sequence[Completion]) -> list[dict[str, object]]:
    found = []
    for c in completions:
        if c.request_id is None or not cluster.router_alive():
            continue
        try:
            found.append(http_json(f"{cluster.router_url}/debug/requests/{c.request_id}"))
        except (OSError, urllib.error.URLError):
            continue
    return found


def _prefills_without_reservation(timeline: dict[str, object]) -> int:
    """PREFILLING transitions not preceded by a RESERVED since the previous one (invariant 5)."""
    reserved, wasted = False, 0
    for t in timeline["history"]:  # type: ignore[attr-defined]
        if t["state"] == "RESERVED":
            reserved = True
        elif t["state"] == "PREFILLING":
            wasted += not reserved
            reserved = False
    return wasted


def _waterfall(timeline: dict[str, object]) -> list[str]:
    """ "+MS STATE detail" lines of one timeline, for the report."""
    history: list[dict[str, object]] = timeline["history"]  # type: ignore[assignment]
    start = int(history[0]["monotonic_ns"])  # type: ignore[call-overload]
    return [
        f"+{(int(t['monotonic_ns']) - start) / 1e6:.0f}ms {t['state']} {t['detail']}"  # type: ignore[call-overload]
        for t in history
    ]


def _queued(timeline: dict[str, object]) -> bool:
    """Whether the request was refused a reservation before it got one."""
    for t in timeline["history"]:  # type: ignore[attr-defined]
        if t["state"] == "RESERVED":
            return False
        if t["state"] == "RETRYING":
            return True
    return False


def _breaker_transitions(router_url: str) -> list[str]:
    """ "from->to" for every breaker transition counted in the router's /metrics."""
    with urllib.request.urlopen(f"{router_url}/metrics", timeout=5) as resp:
        samples = parse_exposition(resp.read().decode())
    name = metric_names.ROUTER_BREAKER_TRANSITIONS.name
    return [
        f"{s.label('from')}->{s.label('to')}" for s in samples if s.name == name and s.value > 0
    ]


async def _kill_mid_decode(cluster: ChaosCluster, result: ScenarioResult) -> OnTokens:
    """A token callback that SIGKILLs the first decode worker found running a request."""
    done = asyncio.Event()

    async def on_tokens(num_tokens: int) -> None:
        if num_tokens < _KILL_AFTER_TOKENS or done.is_set():
            return
        done.set()
        for spec in cluster.specs:
            if spec.role == "prefill" or not cluster.alive(spec.name):
                continue
            health = await asyncio.to_thread(cluster.health, spec.name)
            if int(health["num_running"]) > 0:  # type: ignore[call-overload]
                await asyncio.to_thread(cluster.kill, spec.name)
                result.facts["killed"] = spec.name
                return

    return on_tokens


# Request indexes of the flap phases: failing until open, while open, healed until closed.
_FLAP_FAILING = range(0, 8)
_FLAP_OPEN = range(8, 10)
_FLAP_HEALED = range(10, 22)


async def _flap(
    cluster: ChaosCluster, scenario: Scenario, config: ChaosConfig, result: ScenarioResult
) -> list[tuple[int, Completion]]:
    """Plans on until the breaker opens, requests while open, plans off until it closes."""
    router = cluster.router_url
    completions: list[tuple[int, Completion]] = []

    def breaker_state() -> str:
        return str(http_json(f"{router}/health")["breaker"]["state"])  # type: ignore[index]

    async def one(index: int) -> None:
        completions.extend(await _workload(cluster, [index], config.max_tokens))

    for name, rules in scenario.plans:
        cluster.set_faults(name, rules)
    for i in _FLAP_FAILING:
        await one(i)
        if breaker_state() == "open":
            break
    for i in _FLAP_OPEN:  # colocated while open
        await one(i)
    result.injected = cluster.injected()  # a new plan resets the record
    for name, _ in scenario.plans:
        cluster.set_faults(name, ())
    for i in _FLAP_HEALED:
        await asyncio.sleep(0.5)
        await one(i)
        if breaker_state() == "closed":
            break
    return completions


def _check_baseline(
    baseline: Sequence[tuple[int, Completion]],
    reference: dict[int, Outcome],
    result: ScenarioResult,
) -> None:
    """A fault-free pass must equal the reference: otherwise no fault can be judged."""
    for i, c in baseline:
        if c.error is not None or tuple(c.token_ids) != reference[i].token_ids:
            result.failures.append(
                f"the fault-free baseline of request {i} differs from the reference"
                f" ({c.error or 'other tokens'})"
            )


async def _run_scenario(
    scenario: Scenario, config: ChaosConfig, reference: dict[int, Outcome], workdir: Path
) -> ScenarioResult:
    result = ScenarioResult(scenario.name, scenario.summary, latency_judged=scenario.latency_judged)
    cluster = ChaosCluster(
        scenario.workers, scenario.router_args, workdir / scenario.name, config.model
    )
    start = time.perf_counter()
    try:
        await asyncio.to_thread(cluster.start)
        await _workload(cluster, [0], config.max_tokens)  # warm-up
        indexes = list(range(config.num_requests))
        if scenario.latency_judged:
            # Side by side: the same workload on the same cluster just before the fault.
            baseline = await _workload(cluster, indexes, config.max_tokens)
            _check_baseline(baseline, reference, result)
            health = http_json(f"{cluster.router_url}/health")
            if health["breaker"]["state"] != "closed":  # type: ignore[index]
                result.failures.append(
                    "fault-free handoffs failed in the baseline and opened the breaker:"
                    " is the machine too loaded for the lease TTL?"
                )
            reference = {**reference, **{i: _outcome(i, c) for i, c in baseline}}
            ttfts = [c.ttft_s for _, c in baseline if c.ttft_s is not None]
            result.latency_bound_s = percentile(ttfts, 50) + LATENCY_SLACK_S
        await asyncio.sleep(0.2)
        result.pinned_idle = _pinned(cluster)
        on_tokens: OnTokens | None = None
        if scenario.trigger is Trigger.PLAN:
            for name, rules in scenario.plans:
                cluster.set_faults(name, rules)
        elif scenario.trigger is Trigger.KILL_MID_DECODE:
            on_tokens = await _kill_mid_decode(cluster, result)
        if scenario.trigger is Trigger.FLAP:
            completions = await _flap(cluster, scenario, config, result)
        else:
            completions = await _workload(cluster, indexes, config.max_tokens, on_tokens)
        outcomes = [_outcome(i, c) for i, c in completions]
        # Tokens against the reference run; latency against this cluster's baseline.
        measure_outputs(result, list(reference.values()), outcomes, REQUEST_TIMEOUT_S)
        result.dead_workers = cluster.dead_workers()
        result.injected += cluster.injected()
        _collect_facts(scenario, cluster, [c for _, c in completions], result, config.plot_dir)
        await asyncio.sleep(LEASE_TTL_S + _REAP_SLACK_S)
        after = _pinned(cluster)
        result.pinned_after_ttl = after
        result.num_leaked_blocks = sum(
            max(0, n - result.pinned_idle.get(name, 0)) for name, n in after.items()
        )
    except Exception as exc:
        log.exception("scenario %s could not run", scenario.name)
        result.failures.append(f"the scenario could not run: {type(exc).__name__}: {exc}")
    finally:
        await asyncio.to_thread(cluster.stop)
        result.wall_s = time.perf_counter() - start
    return result


def _collect_facts(
    scenario: Scenario,
    cluster: ChaosCluster,
    completions: Sequence[Completion],
    result: ScenarioResult,
    plot_dir: Path | None = None,
) -> None:
    if not cluster.router_alive():
        result.facts["router_alive"] = False
        return
    timelines = _timelines(cluster, completions)
    slowest = max(completions, key=lambda c: c.latency_s, default=None)
    # The plot shows how a faulted request that still finished spent its time.
    done = [c for c in completions if c.error is None]
    slowest_done = max(done, key=lambda c: c.latency_s, default=None)
    plot_id = slowest_done.request_id if slowest_done is not None else None
    for t in timelines:
        if slowest is not None and t["request_id"] == slowest.request_id:
            result.facts["slowest_timeline"] = _waterfall(t)
        if plot_dir is not None and plot_id is not None and t["request_id"] == plot_id:
            path = plot_dir / f"{scenario.name}.png"
            save_plot(t, path)
            result.facts["timeline_plot"] = str(path)
    result.facts["num_wasted_prefills"] = sum(_prefills_without_reservation(t) for t in timelines)
    result.facts["num_queued"] = sum(_queued(t) for t in timelines)
    if scenario.expect_unused:
        urls = [cluster.url(name) for name in scenario.expect_unused]
        result.facts["num_routed_to_unused"] = sum(
            any(url in str(t["history"]) for url in urls) for t in timelines
        )
        problems = http_json(f"{cluster.router_url}/health").get("problems", [])
        result.facts["health_problems"] = problems
        result.facts["health_names_skew"] = any(
            "quantization" in p and all(url in p for url in urls)
            for p in problems  # type: ignore[attr-defined]
        )
    if scenario.expect_breaker_cycle:
        result.facts["breaker_transitions"] = _breaker_transitions(cluster.router_url)


async def run_chaos_async(config: ChaosConfig) -> list[ScenarioResult]:
    """Reference run, then every scenario; each result judged."""
    workdir = config.workdir or Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    reference_cluster = ChaosCluster(standard_workers(), (), workdir / "reference", config.model)
    try:
        await asyncio.to_thread(reference_cluster.start)
        await _workload(reference_cluster, [0], config.max_tokens)  # warm-up
        # Every index any scenario sends (the flap phases go furthest), in workload batches.
        completions: list[tuple[int, Completion]] = []
        indexes = range(max(config.num_requests, _FLAP_HEALED.stop))
        for at in range(0, len(indexes), config.num_requests):
            batch = indexes[at : at + config.num_requests]
            completions += await _workload(reference_cluster, batch, config.max_tokens)
    finally:
        await asyncio.to_thread(reference_cluster.stop)
    reference = {i: _outcome(i, c) for i, c in completions}
    broken = [c.error for _, c in completions if c.error is not None]
    if broken:
        raise RuntimeError(f"the fault-free reference run failed: {broken[:3]}")
    slots = asyncio.Semaphore(max(1, config.concurrency))

    async def judged(scenario: Scenario) -> ScenarioResult:
        async with slots:
            result = await _run_scenario(scenario, config, reference, workdir)
        result.failures += judge(scenario, result, config.strict_latency)
        log.info("scenario %s: %s", scenario.name, "ok" if result.passed else result.failures)
        return result

    # gather keeps the scenarios' order in the results, whatever order they finish in.
    return list(await asyncio.gather(*(judged(s) for s in config.scenarios)))


def render_table(results: Sequence[ScenarioResult]) -> str:
    """One line per scenario: requests, tokens, leaks, latency, verdict."""
    head = (
        f"{'scenario':<26} {'sent':>4} {'ok':>3} {'fail':>4} {'diverg':>6} {'lost':>4}"
        f" {'dup':>3} {'leaked':>6} {'extra p50':>9} {'extra p99':>9} {'wall':>6}  verdict"
    )
    lines = [head, "-" * len(head)]
    for r in results:

        def sec(v: float) -> str:
            return "-" if math.isnan(v) else f"{v:.2f}s"

        verdict = "PASS" if r.passed else "FAIL: " + "; ".join(r.failures)
        lines.append(
            f"{r.scenario:<26} {r.num_sent:>4} {r.num_completed:>3} {r.num_failed:>4}"
            f" {r.num_divergent:>6} {r.num_tokens_lost:>4} {r.num_tokens_duplicated:>3}"
            f" {r.num_leaked_blocks:>6} {sec(r.extra_latency_p50_s):>9}"
            f" {sec(r.extra_latency_p99_s):>9} {r.wall_s:>5.0f}s  {verdict}"
        )
    lines.append(
        "extra latency: faulted minus fault-free e2e of the same request on the same cluster;"
        f" bound: that cluster's TTFT p50 (one re-prefill) + {LATENCY_SLACK_S:.0f} s"
    )
    return "\n".join(lines)


def run_chaos(config: ChaosConfig) -> int:
    """The `pdserve chaos` command: 0 when every scenario met every target."""
    if config.plot_dir is not None:
        load_pyplot()  # a missing extra fails now, not inside every scenario
        config.plot_dir.mkdir(parents=True, exist_ok=True)
    results = asyncio.run(run_chaos_async(config))
    print(render_table(results))
    if config.json_path is not None:
        config.json_path.write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0 if all(r.passed for r in results) else 1
