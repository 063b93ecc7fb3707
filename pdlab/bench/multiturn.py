"""`pdserve bench multiturn`: multi-turn chats, round-robin placement against affinity routing.

Workload (fixed seed): `num_chats` conversations run concurrently for `num_turns` turns, in
lockstep (every chat finishes turn t before turn t+1 starts, so per-turn worker counters are
exact). Turn 1's prompt is `first_tokens` random token ids; each later prompt is the previous
prompt + the previous output (`output_tokens`, greedy, ignore_eos) + `user_tokens` new ids, sent
as token ids to /v1/completions (streamed) with the chat's id as the OpenAI `user` (the session).
Requests of one turn start in a seeded random order, so round-robin tickets do not line up with
chats by accident.

Each routing runs on its own fresh local cluster (`launcher.Cluster`: prefill + decode workers
and a router with `--routing ...`; all stopped by PID at the end), so no cache is shared; the
routings take turns within each turn, so background load hits them alike:
- `round_robin`: placement ignores caches and load (the baseline);
- `affinity-transfer`: affinity with local prefill off: the suffix is prefilled on a prefill
  worker and only the blocks the decode worker lacks travel;
- `affinity`: the default: the holder prefills a short suffix itself, nothing travels;
- `affinity-2routers`: `affinity` on a cluster with two routers, each chat's turns
  alternating between them (turn t of chat i goes to router (t + i) mod 2): no router sees two
  turns of a chat in a row, so placement rests on the prefix index both build from the
  workers' KV events. Its hit rate and TTFT ratio against round-robin are compared with the
  one-router `affinity` (`two_router_*` in the summary: within 10 % is the target).

Measured per turn: TTFT (send to the first streamed token, client side), tokens prefilled (sum
of the workers' `pdserve_worker_prefill_tokens_total`), KV bytes received (sum of
`pdserve_worker_kv_received_bytes_total`). Prefix hit rate = reused / reusable tokens over turns
2..T, where reusable is what a block cache can reuse of the previous turn (whole blocks of the
previous prompt + output, less the last output token, whose KV is never computed) and reused
is prompt tokens minus tokens prefilled; the stricter per-token rate divides by every token the
previous turn computed (its partial last block counts as missed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from pdlab.bench.local_clusters import local_clusters
from pdlab.bench.stream_events import stream_events
from pdserve.config_file import add_config_flag
from pdserve.errors import ConfigError
from pdserve.observability.exposition import parse as parse_exposition
from pdserve.settings import add_fields, build, setting
from pdserve.supervise.launcher import UpConfig

ROUTINGS: dict[str, tuple[str, ...]] = {
    "round_robin": ("--routing", "round_robin"),
    "affinity-transfer": ("--routing", "affinity", "--local-prefill-threshold", "0"),
    "affinity": ("--routing", "affinity"),
    "affinity-2routers": ("--routing", "affinity"),
}
# Routers per routing's cluster (1 when not named).
NUM_ROUTERS = {"affinity-2routers": 2}
_WORKER_PREFIX = "pdserve_worker_"


@dataclass(frozen=True, slots=True)
class MultiTurnConfig:
    """The workload and the cluster it runs on."""

    num_chats: int = setting(5, name="chats", help="concurrent conversations")
    num_turns: int = setting(6, name="turns")
    first_tokens: int = setting(256)
    user_tokens: int = setting(64)
    output_tokens: int = setting(32)
    seed: int = setting(0)
    num_prefill: int = setting(2, name="prefill", help="prefill workers")
    num_decode: int = setting(2, name="decode", help="decode workers")
    block_size: int = 16
    routings: tuple[str, ...] = setting(
        tuple(ROUTINGS),
        name="routing",
        action="append",
        choices=tuple(ROUTINGS),
        to_field=lambda names: tuple(names or ROUTINGS),
        to_flag=lambda names: None,
        help="repeatable; default all",
    )

    def __post_init__(self) -> None:
        # The headline figure is TTFT over turns >= 4: fewer turns leave nothing to report.
        bounds = {"chats": (self.num_chats, 1), "turns": (self.num_turns, 4)}
        bounds |= {"first-tokens": (self.first_tokens, 1), "user-tokens": (self.user_tokens, 1)}
        bounds |= {"output-tokens": (self.output_tokens, 1), "decode": (self.num_decode, 1)}
        bounds |= {"prefill": (self.num_prefill, 1)}
        for flag, (value, low) in bounds.items():
            if value < low:
                raise ConfigError(f"--{flag}: must be >= {low}, got {value}")
        unknown = [r for r in self.routings if r not in ROUTINGS]
        if unknown:
            raise ConfigError(f"--routing: {unknown[0]!r} is not one of {', '.join(ROUTINGS)}")


@dataclass(slots=True)
class TurnResult:
    """One turn of every chat under one routing."""

    turn: int
    ttft_ms_mean: float
    ttft_ms_max: float
    num_prompt_tokens: int
    num_prefilled_tokens: int
    num_reusable_tokens: int
    # Every token the previous turn computed (prompt + output but its last), partial block
    # included: the strict denominator.
    num_seen_tokens: int
    kv_bytes: int
    # New tokens of this turn (previous output + user message; the whole prompt at turn 1).
    num_new_tokens: int
    # Each chat's TTFT this turn (empty: not recorded).
    ttft_ms: list[float] = field(default_factory=list)


@dataclass(slots=True)
class RoutingResult:
    routing: str
    turns: list[TurnResult] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Reused / block-reusable tokens over turns 2..T."""
        later = self.turns[1:]
        reusable = sum(t.num_reusable_tokens for t in later)
        return self._reused() / reusable if reusable else 0.0

    @property
    def token_hit_rate(self) -> float:
        """Reused / every token computed in the previous turn (partial blocks count as misses)."""
        seen = sum(t.num_seen_tokens for t in self.turns[1:])
        return self._reused() / seen if seen else 0.0

    def _reused(self) -> int:
        return sum(t.num_prompt_tokens - t.num_prefilled_tokens for t in self.turns[1:])

    def ttft_ms_from(self, turn: int) -> float:
        """Mean of the per-turn mean TTFTs from `turn` on."""
        return statistics.fmean(t.ttft_ms_mean for t in self.turns if t.turn >= turn)

    def ttft_ms_p50_from(self, turn: int) -> float:
        """Median TTFT of every request from `turn` on (per-turn means if none recorded)."""
        later = [t for t in self.turns if t.turn >= turn]
        each = [ms for t in later for ms in t.ttft_ms] or [t.ttft_ms_mean for t in later]
        return statistics.median(each)


def _scrape(urls: list[str]) -> dict[str, float]:
    """Worker counters summed over `urls`, by name without the `pdserve_worker_` prefix."""
    total: dict[str, float] = {}
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            samples = parse_exposition(resp.read().decode())
        for s in samples:
            # Series labelled by the worker alone: counters and gauges, not histogram buckets.
            if s.name.startswith(_WORKER_PREFIX) and [k for k, _ in s.labels] == ["worker_id"]:
                key = s.name.removeprefix(_WORKER_PREFIX)
                total[key] = total.get(key, 0.0) + s.value
    return total


async def _turn(
    session: aiohttp.ClientSession, router: str, model: str, chat: str, prompt: list[int], n: int
) -> tuple[float, list[int]]:
    """One streamed completion: (TTFT in seconds, output token ids)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "user": chat,
    }
    start = time.monotonic()
    ttft: float | None = None
    out: list[int] = []
    async for event in stream_events(session, f"{router}/v1/completions", body, chat):
        ids = event["choices"][0].get("token_ids") or []
        if ids and ttft is None:
            ttft = time.monotonic() - start
        out.extend(ids)
    if ttft is None or len(out) != n:
        raise RuntimeError(f"{chat}: got {len(out)} tokens, want {n}")
    return ttft, out


async def _delayed_turn(
    delay_s: float,
    session: aiohttp.ClientSession,
    router: str,
    model: str,
    chat: str,
    prompt: list[int],
    n: int,
) -> tuple[float, list[int]]:
    # Seeded start jitter: each turn's requests arrive in a random (reproducible) order.
    await asyncio.sleep(delay_s)
    return await _turn(session, router, model, chat, prompt, n)


@dataclass(slots=True)
class _Chats:
    """One routing's cluster endpoints and its conversations so far."""

    routing: str
    routers: list[str]
    model: str
    workers: list[str]
    prompts: list[list[int]]
    reusable: list[int]
    seen: list[int]
    new: list[int]
    result: RoutingResult


async def _run_turn(
    chats: _Chats,
    session: aiohttp.ClientSession,
    config: MultiTurnConfig,
    turn: int,
    delays: list[float],
    users: list[list[int]],
) -> None:
    """Turn `turn` of every conversation of one routing, all at once; records its row."""
    n = config.output_tokens
    before = _scrape(chats.workers)
    answers = await asyncio.gather(
        *(
            _delayed_turn(
                delays[i],
                session,
                chats.routers[(turn + i) % len(chats.routers)],
                chats.model,
                f"chat-{i}",
                prompt,
                n,
            )
            for i, prompt in enumerate(chats.prompts)
        )
    )
    after = _scrape(chats.workers)
    ttfts = [a[0] * 1e3 for a in answers]

    def grew(name: str) -> int:
        return round(after.get(name, 0.0) - before.get(name, 0.0))

    chats.result.turns.append(
        TurnResult(
            turn=turn,
            ttft_ms_mean=statistics.fmean(ttfts),
            ttft_ms_max=max(ttfts),
            num_prompt_tokens=sum(len(p) for p in chats.prompts),
            num_prefilled_tokens=grew("prefill_tokens_total"),
            num_reusable_tokens=sum(chats.reusable),
            num_seen_tokens=sum(chats.seen),
            kv_bytes=grew("kv_received_bytes_total"),
            num_new_tokens=sum(chats.new),
            ttft_ms=ttfts,
        )
    )
    bs = config.block_size
    for i, (_, out) in enumerate(answers):
        # Whole blocks of what this turn computed: prompt + output but its last token.
        chats.seen[i] = len(chats.prompts[i]) + len(out) - 1
        chats.reusable[i] = chats.seen[i] // bs * bs
        chats.new[i] = len(out) + len(users[i])
        chats.prompts[i] = [*chats.prompts[i], *out, *users[i]]


async def _run_all(
    config: MultiTurnConfig, clusters: dict[str, tuple[list[str], str, list[str]]]
) -> list[RoutingResult]:
    """Every routing's chats, turn by turn, the routings interleaved within each turn.

    Interleaving (and rotating which routing goes first) exposes every routing to the same
    background load, which on a shared machine moves TTFT more than anything measured here.
    The workload is identical for all: same seed, greedy outputs of the same model.
    """
    rng = random.Random(config.seed)
    vocab = (40, 2000)  # ordinary ids of the tiny model, clear of special tokens
    first = [
        [rng.randrange(*vocab) for _ in range(config.first_tokens)] for _ in range(config.num_chats)
    ]
    k = config.num_chats
    all_chats = [
        _Chats(
            routing,
            routers,
            model,
            workers,
            [list(p) for p in first],
            [0] * k,
            [0] * k,
            [config.first_tokens] * k,
            RoutingResult(routing),
        )
        for routing, (routers, model, workers) in clusters.items()
    ]
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for turn in range(1, config.num_turns + 1):
            delays = [rng.uniform(0.0, 0.02) for _ in range(k)]
            users = [[rng.randrange(*vocab) for _ in range(config.user_tokens)] for _ in range(k)]
            shift = (turn - 1) % len(all_chats)
            for chats in all_chats[shift:] + all_chats[:shift]:
                await _run_turn(chats, session, config, turn, delays, users)
    return [c.result for c in all_chats]


def run_routings(config: MultiTurnConfig) -> list[RoutingResult]:
    """Start one cluster per routing, run the chats interleaved, stop every cluster."""
    workdir = Path(os.environ.get("TMPDIR", "/tmp"))
    configs = {
        routing: UpConfig(
            num_prefill=config.num_prefill,
            num_decode=config.num_decode,
            port=0,
            block_size=config.block_size,
            router_args=ROUTINGS[routing],
            num_routers=NUM_ROUTERS.get(routing, 1),
            state_file=workdir / f"pdserve-bench-multiturn-{os.getpid()}-{routing}.json",
        )
        for routing in config.routings
    }
    with local_clusters(configs) as clusters:
        endpoints = {name: (e.routers, e.model, e.workers) for name, e in clusters.items()}
        return asyncio.run(_run_all(config, endpoints))


def render_table(results: list[RoutingResult]) -> str:
    """One row per routing and turn: TTFT, tokens prefilled, reusable, KV bytes per new token."""
    head = f"{'routing':<18} {'turn':>4} {'TTFT ms':>9} {'prefilled':>9} {'reusable':>9}"
    head += f" {'KV bytes':>10} {'new tok':>7} {'B/new tok':>9}"
    lines = [head, "-" * len(head)]
    for r in results:
        for t in r.turns:
            per = t.kv_bytes / t.num_new_tokens if t.num_new_tokens else 0.0
            lines.append(
                f"{r.routing:<18} {t.turn:>4} {t.ttft_ms_mean:>9.1f} {t.num_prefilled_tokens:>9}"
                f" {t.num_reusable_tokens:>9} {t.kv_bytes:>10} {t.num_new_tokens:>7} {per:>9.0f}"
            )
    return "\n".join(lines)


def two_router_comparison(results: list[RoutingResult]) -> dict[str, float]:
    """`affinity-2routers` against one-router `affinity`: the ratios of their prefix hit rates
    and of their TTFT gains over round-robin (1.0: the same; the target is within 10 %).

    The gains use the median TTFT of every request from turn 4 on: the routings' tokens
    prefilled and bytes moved are equal turn by turn, and on a shared machine one slow turn
    moves a mean of per-turn means by a third (measured), a median of 24+ requests far less."""
    by_name = {r.routing: r for r in results}
    one, two = by_name.get("affinity"), by_name.get("affinity-2routers")
    base = by_name.get("round_robin")
    if one is None or two is None or base is None or not one.hit_rate:
        return {}
    gain_one = base.ttft_ms_p50_from(4) / one.ttft_ms_p50_from(4)
    gain_two = base.ttft_ms_p50_from(4) / two.ttft_ms_p50_from(4)
    hit = two.hit_rate / one.hit_rate
    ttft = gain_two / gain_one
    return {
        "two_router_hit_rate_ratio": hit,
        "two_router_ttft_gain_ratio": ttft,
        "two_router_ttft_gain_ratio_of_means": (
            (base.ttft_ms_from(4) / two.ttft_ms_from(4))
            / (base.ttft_ms_from(4) / one.ttft_ms_from(4))
        ),
        "two_router_within_10pct": float(abs(hit - 1) <= 0.1 and abs(ttft - 1) <= 0.1),
    }


def run_multiturn_bench(args: argparse.Namespace) -> int:
    """The `pdserve bench multiturn` command."""
    config = build(MultiTurnConfig, args)
    # Several workers share the machine's cores: one intra-op thread each (inherited).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    results = run_routings(config)
    print(render_table(results))
    by_name = {r.routing: r for r in results}
    print()
    for r in results:
        print(
            f"{r.routing:<18} prefix hit rate {r.hit_rate:.3f} (per computed token"
            f" {r.token_hit_rate:.3f})   TTFT turns>=4 mean {r.ttft_ms_from(4):.1f} ms,"
            f" p50 {r.ttft_ms_p50_from(4):.1f} ms"
        )
    base = by_name.get("round_robin")
    summary: dict[str, float] = {}
    if base is not None:
        for r in results:
            if r is base:
                continue
            ratio = base.ttft_ms_from(4) / r.ttft_ms_from(4)
            summary[f"ttft_ratio_round_robin_over_{r.routing}"] = ratio
            print(f"TTFT turns>=4: round_robin / {r.routing} = {ratio:.2f}x")
    two = two_router_comparison(results)
    if two:
        summary |= two
        print(
            f"two routers vs one: hit rate x{two['two_router_hit_rate_ratio']:.3f}, TTFT gain"
            f" over round_robin x{two['two_router_ttft_gain_ratio']:.3f} (p50; of means"
            f" x{two['two_router_ttft_gain_ratio_of_means']:.3f})"
            f" ({'within' if two['two_router_within_10pct'] else 'NOT within'} 10 %)"
        )
    if args.json is not None:
        payload = {
            "config": asdict(config),
            "results": [
                {
                    **asdict(r),
                    "hit_rate": r.hit_rate,
                    "token_hit_rate": r.token_hit_rate,
                    "ttft_ms_turns_ge_4": r.ttft_ms_from(4),
                    "ttft_ms_p50_turns_ge_4": r.ttft_ms_p50_from(4),
                }
                for r in results
            ],
            "summary": summary,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's flags (defaults: ~1-2 minutes with the tiny model on 2 cores)."""
    add_fields(p, MultiTurnConfig)
    # Where the results go is not part of what is measured (the JSON holds the config).
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results here")
    add_config_flag(p)
