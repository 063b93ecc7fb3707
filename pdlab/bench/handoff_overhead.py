"""What the split adds to a single request at low load: TTFT disaggregated minus colocated.

Two local clusters (`launcher.Cluster`, as `pdserve up` starts them, stopped by PID at the end)
of the same shape, one prefill and one decode worker each, on a KV-heavy checkpoint written for
the run (`kv_heavy_model`): `disagg` (router `--mode disagg`, local prefill and the circuit
breaker off, so every request's KV travels) and `colocated` (router `--mode colocated`: the
decode worker runs it whole). Both clusters first serve the same warm-up prompts (pooled KV connections open, code
paths warm); then each measured prompt goes to both, one request at a time, the first cluster
alternating, greedy with EOS ignored.

For each disaggregated request the prefill worker's `/metrics` give its KV's transfer time
(`pdserve_worker_kv_send_seconds`, first connect to final Ack: the sum's increase over that one
request) and bytes, and the decode worker's say over which transport it arrived. The arithmetic
is `handoff_stats`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from pdlab.bench.handoff_stats import OverheadSummary, RequestTiming, summarize
from pdlab.bench.kv_heavy_model import KVHeavyShape, build_kv_heavy_checkpoint
from pdserve.advise.client import stream_completion
from pdserve.advise.flags import at_least, checked
from pdserve.errors import ConfigError, PdserveError
from pdserve.observability import metric_names as m
from pdserve.observability.exposition import Sample, parse, total
from pdserve.observability.trace import TraceError, fetch_timeline
from pdserve.supervise.launcher import Cluster, UpConfig

MODES = ("disagg", "colocated")
# Every disaggregated request must hand off: no local prefill, and no breaker (on a busy host a
# same-host transfer can run below the "slow" floor, and the breaker would then colocate).
ROUTER_ARGS: dict[str, tuple[str, ...]] = {
    "disagg": ("--local-prefill-threshold", "0", "--no-breaker"),
    "colocated": ("--no-breaker",),
}
# Seconds to wait for the prefill worker to record the send after the request ended.
_SEND_RECORD_TIMEOUT_S = 10.0


class HandoffBenchError(PdserveError):
    """A request of the handoff benchmark failed or its KV transfer could not be measured."""


@dataclass(frozen=True, slots=True)
class HandoffConfig:
    """What the handoff-overhead part measures."""

    num_requests: int = checked(
        8,
        at_least(1),
        name="handoff-requests",
        help="measured single requests per mode in the handoff part",
    )
    num_warmup: int = checked(
        2, at_least(0), name="handoff-warmup", help="warm-up requests per mode before them"
    )
    prompt_tokens: int = checked(
        256,
        at_least(1),
        name="handoff-prompt-tokens",
        help="prompt length of the handoff part (128 KiB of KV per token)",
    )
    # At least 2: the second token is where the transfer shows.
    max_tokens: int = 4
    seed: int = 0
    request_timeout_s: float = 180.0
    shape: KVHeavyShape = field(default_factory=KVHeavyShape)

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.num_warmup < 0:
            raise ConfigError(
                f"--handoff-requests: need >= 1 (and warm-up >= 0), got {self.num_requests}"
            )
        if not 16 <= self.prompt_tokens <= 2048:
            raise ConfigError(
                f"--handoff-prompt-tokens: must be in 16..2048, got {self.prompt_tokens}"
            )
        if self.max_tokens < 2:
            raise ConfigError(f"handoff max_tokens: must be >= 2, got {self.max_tokens}")


@dataclass(frozen=True, slots=True)
class _Target:
    """A started cluster as this benchmark uses it."""

    mode: str
    router_url: str
    model_name: str
    prefill_url: str
    decode_url: str


def _worker_url(cluster: Cluster, prefix: str) -> str:
    for name in cluster.supervisor.names():
        url = cluster.supervisor.url(name)
        if name.startswith(prefix) and url:
            return url
    raise HandoffBenchError(f"cluster has no started {prefix} worker")


def _scrape(url: str) -> list[Sample]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return parse(resp.read().decode())


@dataclass(frozen=True, slots=True)
class _SendCounters:
    """The prefill worker's acknowledged-send totals, and the decode side's per transport."""

    num_sends: float
    seconds: float
    num_bytes: float
    received_by_transport: dict[str, float]

    @classmethod
    def read(cls, target: _Target) -> _SendCounters:
        sent = _scrape(target.prefill_url)
        received = _scrape(target.decode_url)
        by_transport: dict[str, float] = {}
        for s in received:
            if s.name == m.WORKER_KV_TRANSPORT_HANDOFFS.name and s.label("direction") == "received":
                transport = s.label("transport") or "?"
                by_transport[transport] = by_transport.get(transport, 0.0) + s.value
        return cls(
            total(sent, m.WORKER_KV_SEND_SECONDS.name + "_count"),
            total(sent, m.WORKER_KV_SEND_SECONDS.name + "_sum"),
            total(sent, m.WORKER_KV_SEND_BYTES.name + "_sum"),
            by_transport,
        )


def _prompts(config: HandoffConfig, vocab: int) -> list[list[int]]:
    """Distinct random prompts (warm-up ones first): no prompt is ever in a prefix cache."""
    rng = random.Random(config.seed)
    count = config.num_warmup + config.num_requests
    return [[rng.randrange(3, vocab) for _ in range(config.prompt_tokens)] for _ in range(count)]


async def _one(
    session: aiohttp.ClientSession, target: _Target, prompt: list[int], config: HandoffConfig
) -> RequestTiming:
    """One streamed request; with disagg, its KV's transfer time from the workers' metrics."""
    before = (
        await asyncio.to_thread(_SendCounters.read, target) if target.mode == "disagg" else None
    )
    token_times: list[float] = []
    body: dict[str, object] = {
        "model": target.model_name,
        "prompt": prompt,
        "max_tokens": config.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    start = time.perf_counter()

    async def on_tokens(num_tokens: int) -> None:
        while len(token_times) < min(num_tokens, 2):
            token_times.append(time.perf_counter() - start)

    done = await stream_completion(
        session, target.router_url, body, on_tokens, timeout_s=config.request_timeout_s
    )
    if done.error is not None or len(done.token_ids) != config.max_tokens or len(token_times) < 2:
        raise HandoffBenchError(
            f"{target.mode} request failed: {done.error or f'{len(done.token_ids)} tokens'}"
        )
    worker_ttft_s = await asyncio.to_thread(_worker_ttft, target, done.request_id)
    if before is None:
        return RequestTiming(token_times[0], token_times[1], worker_ttft_s=worker_ttft_s)
    try:
        after = await _sent_after(target, before)
    except HandoffBenchError as exc:
        raise HandoffBenchError(f"{exc}; {_states(target, done.request_id)}") from None
    transports = [
        t
        for t, n in after.received_by_transport.items()
        if n > before.received_by_transport.get(t, 0.0)
    ]
    return RequestTiming(
        token_times[0],
        token_times[1],
        after.seconds - before.seconds,
        int(after.num_bytes - before.num_bytes),
        "/".join(sorted(transports)) or None,
        worker_ttft_s,
    )


# The worker events that bound its own time to the first token, per mode.
_WORKER_SPAN = {
    "disagg": ("prefill_start", "prefill_end"),
    "colocated": ("generate_start", "first_token"),
}


def _worker_ttft(target: _Target, request_id: str | None) -> float | None:
    """The worker's own time from admitting the request to its first token, from the merged
    timeline (None when its events are missing)."""
    if request_id is None:
        return None
    try:
        view = fetch_timeline(target.router_url, request_id, timeout_s=5.0, workers=True)
    except TraceError:
        return None
    at: dict[str, int] = {}
    for event in view.get("merged", []):
        at.setdefault(str(event.get("event")), int(event.get("router_ns", 0)))
    start, end = _WORKER_SPAN[target.mode]
    if start not in at or end not in at:
        return None
    return (at[end] - at[start]) / 1e9


def _states(target: _Target, request_id: str | None) -> str:
    """The request's path through the router (its timeline), to say why it did not hand off."""
    if request_id is None:
        return "no request id"
    try:
        view = fetch_timeline(target.router_url, request_id, timeout_s=5.0)
    except TraceError as exc:
        return f"no timeline: {exc}"
    steps = [f"{h.get('state')}({h.get('detail', '')})" for h in view["history"]]
    return f"request {request_id}: " + " -> ".join(steps)


async def _sent_after(target: _Target, before: _SendCounters) -> _SendCounters:
    """The counters once the request's one send is recorded; HandoffBenchError otherwise."""
    deadline = time.monotonic() + _SEND_RECORD_TIMEOUT_S
    while True:
        after = await asyncio.to_thread(_SendCounters.read, target)
        sends = after.num_sends - before.num_sends
        if sends == 1:
            return after
        if sends > 1 or time.monotonic() > deadline:
            raise HandoffBenchError(
                f"disagg request: {sends:g} KV sends recorded by {target.prefill_url}, want 1"
                " (a colocated fallback, or a retry, is not a handoff)"
            )
        await asyncio.sleep(0.05)


async def _measure(
    config: HandoffConfig, targets: dict[str, _Target], vocab: int
) -> tuple[list[RequestTiming], list[RequestTiming]]:
    prompts = _prompts(config, vocab)
    timings: dict[str, list[RequestTiming]] = {mode: [] for mode in MODES}
    async with aiohttp.ClientSession() as session:
        for i, prompt in enumerate(prompts):
            # The first cluster alternates, so drifting background load favours neither.
            order = MODES if i % 2 == 0 else MODES[::-1]
            for mode in order:
                timing = await _one(session, targets[mode], prompt, config)
                if i >= config.num_warmup:
                    timings[mode].append(timing)
    return timings["disagg"], timings["colocated"]


def run_handoff_overhead(config: HandoffConfig, workdir: Path) -> OverheadSummary:
    """Build the checkpoint, start both clusters, measure, stop every process by PID."""
    checkpoint = build_kv_heavy_checkpoint(workdir / "kv-heavy", config.shape, config.seed)
    clusters: list[Cluster] = []
    try:
        targets: dict[str, _Target] = {}
        for mode in MODES:
            up = UpConfig(
                num_prefill=1,
                num_decode=1,
                mode=mode,
                model=str(checkpoint),
                port=0,
                router_args=ROUTER_ARGS[mode],
                # Not the default file: a running `pdserve up` stays what `status` finds.
                state_file=workdir / f"{mode}.json",
            )
            cluster = Cluster(up)
            clusters.append(cluster)
            router_url = cluster.start()
            with urllib.request.urlopen(f"{router_url}/health", timeout=10) as resp:
                model_name = str(json.loads(resp.read())["model"])
            targets[mode] = _Target(
                mode,
                router_url,
                model_name,
                _worker_url(cluster, "prefill"),
                _worker_url(cluster, "decode"),
            )
        vocab = int(json.loads((checkpoint / "config.json").read_text())["vocab_size"])
        disagg, colocated = asyncio.run(_measure(config, targets, vocab))
    finally:
        for cluster in clusters:
            cluster.stop()
    return summarize(disagg, colocated)
