"""The fault scenarios of `pdserve chaos` and how a run of one is judged. Pure: no processes.

A scenario is a cluster shape (workers and their flags, router flags), a trigger (how the fault
comes: a fault plan posted to workers' `/admin/faults` once the cluster is warm, a SIGKILL by
PID while tokens stream, a plan switched on and off, or nothing but the shape itself) and what
the scenario lets happen (a worker that must die, requests that may fail). Every scenario runs
the same seeded workload, and its outputs are compared with a fault-free reference run of the
same workload: `judge` turns the measures into the list of targets missed.

Targets (DESIGN.md's invariants): 0 divergent outputs, 0 lost or duplicated tokens, 0 leaked
blocks one lease TTL after the last request, no request past its deadline, and extra latency
at most one re-prefill (the reference TTFT) + 1 s. A scenario whose recovery must wait out a
deadline by design (`latency_judged=False`) reports its extra latency without judging it.
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.errors import ConfigError
from pdserve.observability.stats import percentile

# Flags every chaos cluster gets: short leases so orphaned KV is visibly freed within a run,
# yet longer than a reservation waits for its prefill on a loaded 2-core machine (at 2 s,
# fault-free handoffs there timed out and opened the breaker).
LEASE_TTL_S = 4.0
REQUEST_TIMEOUT_S = 30.0
# A stalled chunk is noticed after this (the worker default is 2 s).
CHUNK_TIMEOUT_S = 0.5
# Slack on the extra-latency bound: one re-prefill + this.
LATENCY_SLACK_S = 1.0


class Trigger(enum.StrEnum):
    """How the fault reaches a warm cluster."""

    # POST each worker's plan to /admin/faults, then run the workload.
    PLAN = "plan"
    # SIGKILL (by PID) the decode worker running a request once the client has tokens.
    KILL_MID_DECODE = "kill_mid_decode"
    # Plans on until the breaker opens, off until it closes again.
    FLAP = "flap"
    # The cluster's shape is the fault (too little KV, a skewed worker).
    NONE = "none"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker of a scenario's cluster."""

    name: str
    role: str
    # Extra `pdserve worker` flags.
    args: tuple[str, ...] = ()


def standard_workers(*extra: WorkerSpec) -> tuple[WorkerSpec, ...]:
    """Two prefill and two decode (role both) workers, the shape most scenarios use."""
    return (
        WorkerSpec("prefill-0", "prefill"),
        WorkerSpec("prefill-1", "prefill"),
        WorkerSpec("decode-0", "both"),
        WorkerSpec("decode-1", "both"),
        *extra,
    )


@dataclass(frozen=True, slots=True)
class Scenario:
    """One fault, the cluster it hits, and what it may cost."""

    name: str
    summary: str
    trigger: Trigger
    workers: tuple[WorkerSpec, ...] = field(default_factory=standard_workers)
    # (worker name, fault rules) posted when the trigger is PLAN or FLAP.
    plans: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Extra `pdserve router` flags.
    router_args: tuple[str, ...] = ()
    # Workers that must be dead after the run (the fault killed them).
    expect_dead: tuple[str, ...] = ()
    # The router itself dies: requests fail, only the workers' leases are judged.
    router_dies: bool = False
    # Whether extra latency is held to the bound (see the module docstring).
    latency_judged: bool = True
    # Workers that must never be routed to (version skew), and named in router health.
    expect_unused: tuple[str, ...] = ()
    # Requests must wait for a reservation, and none may be prefilled before it has one.
    expect_queued: bool = False
    # The breaker must open and close again (closed → open → half_open → closed).
    expect_breaker_cycle: bool = False


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "kill_decode_mid_transfer",
        "decode-0 SIGKILLs itself at the first KV chunk it receives",
        Trigger.PLAN,
        plans=(("decode-0", ("transfer.recv_chunk:crash",)),),
        expect_dead=("decode-0",),
    ),
    Scenario(
        "kill_decode_mid_decode",
        "the decode worker streaming a request is SIGKILLed by PID after 5 tokens",
        Trigger.KILL_MID_DECODE,
    ),
    Scenario(
        "kill_decode_mid_decode_checkpointed",
        "the same kill with decode checkpoints on (every block): resumes go through the"
        " checkpoint path (the holder, or the survivor's own prefix cache first)",
        Trigger.KILL_MID_DECODE,
        router_args=("--checkpoint", "every-1", "--checkpoint-lease-ttl-s", str(LEASE_TTL_S)),
    ),
    Scenario(
        "kill_prefill_mid_prefill",
        "prefill-0 SIGKILLs itself as its first prefill starts",
        Trigger.PLAN,
        plans=(("prefill-0", ("worker.prefill:crash",)),),
        expect_dead=("prefill-0",),
    ),
    Scenario(
        "corrupt_chunk",
        "one bit flipped in a KV send on each prefill worker",
        Trigger.PLAN,
        plans=(
            ("prefill-0", ("transfer.send:corrupt:after=2,times=2",)),
            ("prefill-1", ("transfer.send:corrupt:after=2,times=2",)),
        ),
    ),
    Scenario(
        "truncate_transfer",
        "a KV send cut short and its connection closed, on each prefill worker",
        Trigger.PLAN,
        plans=(
            ("prefill-0", ("transfer.send:truncate:after=2",)),
            ("prefill-1", ("transfer.send:truncate:after=2",)),
        ),
    ),
    Scenario(
        "stall_link",
        "a KV send blocks forever on each prefill worker (the per-chunk deadline fires)",
        Trigger.PLAN,
        plans=(
            ("prefill-0", ("transfer.send:stall:after=1",)),
            ("prefill-1", ("transfer.send:stall:after=1",)),
        ),
    ),
    Scenario(
        "decode_full",
        "one decode worker with KV room for about one request at a time: the rest queue",
        Trigger.NONE,
        workers=(
            WorkerSpec("prefill-0", "prefill"),
            # 10 blocks of 16 tokens (64 KiB each on the tiny model).
            WorkerSpec("decode-0", "both", ("--kv-cache-bytes", str(10 * 64 * 1024))),
        ),
        router_args=("--queue-timeout-s", "25"),
        # Waiting for room is the point: latency grows by design.
        latency_judged=False,
        expect_queued=True,
    ),
    Scenario(
        "version_skew",
        "decode-2 runs int8 weights: a different fingerprint that must never be paired",
        Trigger.NONE,
        workers=standard_workers(WorkerSpec("decode-2", "both", ("--quantization", "int8"))),
        expect_unused=("decode-2",),
    ),
    Scenario(
        "flapping_kv_path",
        "every KV send fails until the breaker opens, then heals: half-open probe closes it",
        Trigger.FLAP,
        plans=(
            ("prefill-0", ("transfer.send:close:times=0",)),
            ("prefill-1", ("transfer.send:close:times=0",)),
        ),
        router_args=(
            *("--breaker-window", "4", "--breaker-min-samples", "2"),
            *("--breaker-failure-rate", "0.5", "--breaker-cooldown-s", "1"),
            *("--transfer-attempts", "1", "--max-reprefills", "0"),
        ),
        # Sequential phases paced by the breaker's cooldown: no concurrent baseline to compare.
        latency_judged=False,
        expect_breaker_cycle=True,
    ),
    Scenario(
        "router_dies_mid_handoff",
        "the router SIGKILLs itself after a prefill: both sides' KV is orphaned until leases end",
        Trigger.NONE,
        # after=1: the warm-up request passes the site once.
        router_args=("--fault", "router.after_prefill:crash:after=1"),
        router_dies=True,
        latency_judged=False,
    ),
)


def find_scenarios(name: str) -> tuple[Scenario, ...]:
    """`all`, or one scenario by name; ConfigError lists the names otherwise."""
    if name == "all":
        return SCENARIOS
    for scenario in SCENARIOS:
        if scenario.name == name:
            return (scenario,)
    names = ", ".join(s.name for s in SCENARIOS)
    raise ConfigError(f"scenario: {name!r} is not one of all, {names}")


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request of a run as the client saw it."""

    prompt_index: int
    token_ids: tuple[int, ...]
    finish_reason: str | None
    # The typed error ("type: message") when the request failed, else None.
    error: str | None
    latency_s: float


def lost_and_duplicated(reference: Sequence[int], received: Sequence[int]) -> tuple[int, int]:
    """Tokens of `reference` missing from `received`, and tokens received beyond it (multisets).

    Equal sequences give (0, 0); a token skipped at a resume point counts as lost, one sent
    twice as duplicated, whatever else the sequences share.
    """
    want, got = Counter(reference), Counter(received)
    return sum((want - got).values()), sum((got - want).values())


@dataclass(slots=True)
class ScenarioResult:
    """The measures of one scenario run; `failures` lists the targets it missed."""

    scenario: str
    summary: str
    num_sent: int = 0
    num_completed: int = 0
    num_failed: int = 0
    # Distinct error texts of failed requests.
    errors: list[str] = field(default_factory=list)
    num_divergent: int = 0
    num_tokens_lost: int = 0
    num_tokens_duplicated: int = 0
    num_past_deadline: int = 0
    # Pinned blocks per live worker when idle before the faults, and one TTL after the run.
    pinned_idle: dict[str, int] = field(default_factory=dict)
    pinned_after_ttl: dict[str, int] = field(default_factory=dict)
    num_leaked_blocks: int = 0
    extra_latency_p50_s: float = math.nan
    extra_latency_p99_s: float = math.nan
    latency_bound_s: float = math.nan
    latency_judged: bool = True
    # Workers found dead after the run.
    dead_workers: list[str] = field(default_factory=list)
    # Faults the workers report having injected ("worker: site#hit action").
    injected: list[str] = field(default_factory=list)
    # Scenario-specific facts (breaker transitions, queued requests, prefills per request).
    facts: dict[str, object] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def passed(self) -> bool:
        """Whether every target held."""
        return not self.failures


def measure_outputs(
    result: ScenarioResult,
    reference: Sequence[Outcome],
    outcomes: Sequence[Outcome],
    deadline_s: float,
) -> None:
    """Fill the token, failure, deadline and latency figures of `result` from one run."""
    by_prompt = {o.prompt_index: o for o in reference}
    extra: list[float] = []
    errors: set[str] = set()
    result.num_sent = len(outcomes)
    for outcome in outcomes:
        if outcome.latency_s > deadline_s:
            result.num_past_deadline += 1
        if outcome.error is not None:
            result.num_failed += 1
            errors.add(outcome.error)
            continue
        result.num_completed += 1
        ref = by_prompt[outcome.prompt_index]
        if outcome.token_ids != ref.token_ids:
            result.num_divergent += 1
        lost, duplicated = lost_and_duplicated(ref.token_ids, outcome.token_ids)
        result.num_tokens_lost += lost
        result.num_tokens_duplicated += duplicated
        extra.append(max(0.0, outcome.latency_s - ref.latency_s))
    result.errors = sorted(errors)
    result.extra_latency_p50_s = percentile(extra, 50)
    result.extra_latency_p99_s = percentile(extra, 99)


def judge(scenario: Scenario, result: ScenarioResult, strict_latency: bool = True) -> list[str]:
    """The targets `result` missed, each a sentence naming the figure.

    `strict_latency=False` leaves the extra-latency bound out (it is still measured): on a
    machine shared with other work, latency differences of a second are noise, not faults.
    """
    missed: list[str] = []
    if not scenario.router_dies:
        if result.num_completed != result.num_sent:
            missed.append(
                f"{result.num_failed} of {result.num_sent} requests failed: {result.errors}"
            )
        if result.num_divergent:
            missed.append(f"{result.num_divergent} outputs differ from the fault-free reference")
        if result.num_tokens_lost or result.num_tokens_duplicated:
            missed.append(
                f"{result.num_tokens_lost} tokens lost, {result.num_tokens_duplicated} duplicated"
            )
    elif result.num_completed == result.num_sent:
        missed.append("the router was to die, yet every request completed")
    if result.num_past_deadline:
        missed.append(f"{result.num_past_deadline} requests ran past their deadline")
    if result.num_leaked_blocks:
        missed.append(
            f"{result.num_leaked_blocks} blocks still pinned one lease TTL after the run"
            f" (idle {result.pinned_idle}, after {result.pinned_after_ttl})"
        )
    for name in scenario.expect_dead:
        if name not in result.dead_workers:
            missed.append(f"{name} was to be killed by the fault but is alive")
    unexpected = sorted(set(result.dead_workers) - set(scenario.expect_dead))
    if unexpected and scenario.trigger is not Trigger.KILL_MID_DECODE:
        missed.append(f"workers died that should not have: {unexpected}")
    if scenario.trigger is Trigger.KILL_MID_DECODE and not result.dead_workers:
        missed.append("no decode worker was streaming when the kill was due")
    # A crash leaves no worker to report it: the dead worker is the evidence then.
    fired = result.injected or (scenario.expect_dead and result.dead_workers)
    if scenario.trigger in (Trigger.PLAN, Trigger.FLAP) and not fired:
        missed.append("the fault plan never fired")
    missed += _judge_facts(scenario, result.facts)
    if (
        strict_latency
        and result.latency_judged
        and result.extra_latency_p99_s > result.latency_bound_s
    ):
        missed.append(
            f"extra latency p99 {result.extra_latency_p99_s:.2f} s is over the bound"
            f" {result.latency_bound_s:.2f} s (one re-prefill + {LATENCY_SLACK_S:.0f} s)"
        )
    return missed


BREAKER_CYCLE = ("closed->open", "open->half_open", "half_open->closed")


def _judge_facts(scenario: Scenario, facts: dict[str, object]) -> list[str]:
    missed: list[str] = []
    if scenario.expect_unused:
        if facts.get("num_routed_to_unused") != 0:
            missed.append(
                f"{facts.get('num_routed_to_unused')} requests were routed to"
                f" {list(scenario.expect_unused)}, whose fingerprint differs"
            )
        if not facts.get("health_names_skew"):
            missed.append(f"router health does not name the skew: {facts.get('health_problems')}")
    if scenario.expect_queued:
        if not isinstance(q := facts.get("num_queued"), int) or q < 1:
            missed.append(f"no request waited for a reservation (num_queued={q})")
        if facts.get("num_wasted_prefills") != 0:
            missed.append(
                f"{facts.get('num_wasted_prefills')} prefills ran without a decode reservation"
            )
    if scenario.expect_breaker_cycle:
        seen = facts.get("breaker_transitions")
        if not isinstance(seen, list) or [t for t in BREAKER_CYCLE if t not in seen]:
            missed.append(f"breaker transitions {seen}, expected {list(BREAKER_CYCLE)}")
    return missed
