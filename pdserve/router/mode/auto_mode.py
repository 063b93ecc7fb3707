"""`--mode auto`: when to split `both` workers into prefill and decode roles, at which ratio,
and when to go back. Pure: figures in, a decision with a reason out; no clock, no I/O.

The inputs (`AutoInputs`) are what the router measured over its live window (since the last
change of layout, when that is more recent: a layout is judged by what it produced)
(`interference.LiveFigures`: decode TPOT with and without prefill in the step, SLO attainment,
arrival rates), the engine busy time the workers attribute to each phase (`PhaseLoad`, from
their step totals), how many `both` workers can take a role, and the breaker.

Rules, evaluated every interval (the first that applies wins):

colocated
    fewer than 2 workers                         keep   too_few_workers
    breaker open and cooling down                keep   breaker_open
    a split did not help less than
    `split_backoff_s` ago                        keep   backoff
    fewer than `min_requests` ended in window    keep   few_samples
    TPOT attainment >= target                    keep   within_slo
    fewer than `min_decode_tokens` decode
    tokens without prefill                       keep   few_samples
    mean decode TPOT without prefill > TPOT SLO  keep   decode_bound (a split cannot help)
    under half the TPOT misses interfered        keep   not_interference
    otherwise                                    split  interference, P = round(N x prefill
                                                 share of busy time), 1 <= P <= N - 1

"Interfered" misses are requests over the TPOT SLO at least one of whose decode tokens shared
a step with prefill (`interference.LiveFigures`). Counting requests rather than tokens matters:
a prefill chunk of a long prompt delays one token per decoding request, so mixed tokens are
few while each adds a whole prefill to the request's mean TPOT. The decode-alone test uses the
mean gap without prefill, since a request's TPOT is the mean of its gaps.
split (P prefill, D decode)
    breaker open and cooling down                colocate breaker_open (at once)
    fewer than 2 workers                         colocate too_few_workers (at once)
    prompt tokens/s < low_water x the rate at
    which the split was decided                  colocate load_fell
    TTFT attainment < target, TPOT's met, D > 1  resize   prefill_bound (P + 1)
    TPOT attainment < target, TTFT's met, P > 1  resize   decode_bound (P - 1)
    TPOT attainment < target, TTFT's met, P = 1  colocate split_not_helping (every worker
                                                 decodes again; no split for split_backoff_s)
    otherwise                                    keep     within_slo / few_samples / at_limit

Hysteresis: a change other than the two "at once" ones must be proposed by `sustain`
consecutive evaluations (the same action and target) and may not come within `min_dwell_s` of
the previous change; going back needs the load to fall to `low_water` of the split's load, not
merely below the split threshold. "Breaker open and cooling down" is `BreakerHealth.OPEN`: a
breaker whose cooldown is over may send a half-open probe, so it does not block a split.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

from pdserve.errors import ConfigError
from pdserve.router.mode.interference import LiveFigures, SLOConfig
from pdserve.settings import setting


class Action(enum.Enum):
    """What a decision does to the layout."""

    KEEP = "keep"
    SPLIT = "split"
    RESIZE = "resize"
    COLOCATE = "colocate"


class Reason(enum.Enum):
    """Why (every decision has exactly one)."""

    INTERFERENCE = "interference"
    PREFILL_BOUND = "prefill_bound"
    DECODE_BOUND = "decode_bound"
    LOAD_FELL = "load_fell"
    BREAKER_OPEN = "breaker_open"
    TOO_FEW_WORKERS = "too_few_workers"
    FEW_SAMPLES = "few_samples"
    WITHIN_SLO = "within_slo"
    NOT_INTERFERENCE = "not_interference"
    AT_LIMIT = "at_limit"
    SUSTAINING = "sustaining"
    DWELL = "dwell"
    SPLIT_NOT_HELPING = "split_not_helping"
    BACKOFF = "backoff"


class BreakerHealth(enum.Enum):
    """The KV path as the breaker sees it."""

    CLOSED = "closed"
    # Open and within its cooldown: a split would only colocate again.
    OPEN = "open"
    # Half-open, or open with the cooldown over: a probe may test the path.
    PROBING = "probing"


@dataclass(frozen=True, slots=True)
class AutoConfig:
    """Thresholds and hysteresis of the automatic mode."""

    interval_s: float = setting(1.0)
    # The live window the figures cover (router/mode/interference.py).
    window_s: float = setting(
        10.0, help="seconds of live figures each decision (and the attainment gauges) covers"
    )
    # No change within this long of the previous one (the breaker's colocate excepted).
    min_dwell_s: float = setting(
        15.0, help="no change of mode or ratio within this long of the previous one"
    )
    # Consecutive evaluations that must propose the same change before it is made.
    sustain: int = setting(3, help="consecutive evaluations that must propose the same change")
    # Requests ended in the window before attainment is trusted.
    min_requests: int = setting(8)
    # Decode tokens without prefill before "decode alone meets the TPOT SLO" is trusted.
    min_decode_tokens: int = 10
    # Fraction of TPOT misses that must have shared a step with prefill to blame prefill.
    interfered_share: float = 0.5
    # Attainment (fraction of requests meeting an SLO) below which the SLO counts as broken.
    target_attainment: float = setting(0.9)
    # Back to colocated when prompt tokens/s fall below this fraction of the split's.
    low_water: float = setting(
        0.5, help="back to colocated below this fraction of the prompt tokens/s at the split"
    )
    # After a split was undone for not helping, no new split for this long.
    split_backoff_s: float = setting(
        120.0, help="after a split was undone for not helping, no new split for this long"
    )

    def __post_init__(self) -> None:
        for name, value in (
            ("--auto-interval-s", self.interval_s),
            ("--auto-window-s", self.window_s),
        ):
            if not (math.isfinite(value) and 0 < value <= 3600):
                raise ConfigError(f"{name}: must be > 0 and at most 3600, got {value:g}")
        if not (math.isfinite(self.min_dwell_s) and 0 <= self.min_dwell_s <= 86400):
            raise ConfigError(f"--auto-min-dwell-s: must be in 0..86400, got {self.min_dwell_s:g}")
        if not 1 <= self.sustain <= 1000:
            raise ConfigError(f"--auto-sustain: must be in 1..1000, got {self.sustain}")
        if not 1 <= self.min_requests <= 1_000_000:
            raise ConfigError(f"--auto-min-requests: must be >= 1, got {self.min_requests}")
        if not self.min_decode_tokens >= 1:
            raise ConfigError(f"min_decode_tokens: must be >= 1, got {self.min_decode_tokens}")
        if not 0 < self.target_attainment <= 1:
            raise ConfigError(
                f"--auto-target-attainment: must be in (0, 1], got {self.target_attainment:g}"
            )
        if not 0 < self.interfered_share <= 1:
            raise ConfigError(f"interfered_share: must be in (0, 1], got {self.interfered_share:g}")
        if not (math.isfinite(self.split_backoff_s) and 0 <= self.split_backoff_s <= 86400):
            raise ConfigError(
                f"--auto-split-backoff-s: must be in 0..86400, got {self.split_backoff_s:g}"
            )
        if not 0 < self.low_water < 1:
            raise ConfigError(f"--auto-low-water: must be in (0, 1), got {self.low_water:g}")


@dataclass(frozen=True, slots=True)
class PhaseLoad:
    """Engine seconds the workers attributed to each phase over the window (all workers)."""

    prefill_busy_s: float = 0.0
    decode_busy_s: float = 0.0

    @property
    def prefill_share(self) -> float:
        """Prefill's part of the busy time (NaN when idle)."""
        total = self.prefill_busy_s + self.decode_busy_s
        return self.prefill_busy_s / total if total > 0 else math.nan


@dataclass(frozen=True, slots=True)
class AutoInputs:
    """One evaluation's view of the cluster."""

    now_s: float
    figures: LiveFigures
    # `both` workers of the compatible group that are healthy (the ones roles go to).
    num_workers: int
    breaker: BreakerHealth
    load: PhaseLoad


@dataclass(frozen=True, slots=True)
class Layout:
    """How the `both` workers are used: colocated (num_prefill 0) or split."""

    num_prefill: int = 0

    @property
    def split(self) -> bool:
        return self.num_prefill > 0


@dataclass(frozen=True, slots=True)
class AutoMemory:
    """What the decisions remember between evaluations."""

    layout: Layout = Layout()
    # When the layout last changed (None: never).
    changed_at_s: float | None = None
    # Prompt tokens/s when the split was decided (the reference of low_water).
    split_prompt_tokens_per_s: float = 0.0
    # The change proposed by the last evaluations, and by how many in a row.
    pending: tuple[Action, int] | None = None
    num_pending: int = 0
    # No split before this time (a split was undone for not helping).
    no_split_before_s: float | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """One evaluation's outcome: the layout to run now, and why."""

    action: Action
    reason: Reason
    layout: Layout
    # The figures that decided it, in words (logged).
    detail: str


def _ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e3:.1f} ms"


def prefill_count(num_workers: int, share: float) -> int:
    """Prefill workers for a busy-time share: round(N x share), at least 1, at most N - 1."""
    p = round(num_workers * share) if math.isfinite(share) else num_workers // 2
    return min(max(1, p), num_workers - 1)


def decide(
    memory: AutoMemory, inputs: AutoInputs, config: AutoConfig, slo: SLOConfig
) -> tuple[Decision, AutoMemory]:
    """The decision for this evaluation and the memory for the next (see the module rules)."""
    proposal = _propose(memory, inputs, config, slo)
    if proposal.action is Action.KEEP:
        return proposal, replace(memory, pending=None, num_pending=0)
    at_once = proposal.reason in (Reason.BREAKER_OPEN, Reason.TOO_FEW_WORKERS)
    if not at_once:
        key = (proposal.action, proposal.layout.num_prefill)
        count = memory.num_pending + 1 if memory.pending == key else 1
        if count < config.sustain:
            keep = Decision(
                Action.KEEP,
                Reason.SUSTAINING,
                memory.layout,
                f"{proposal.action.value} ({proposal.reason.value}) proposed {count}/"
                f"{config.sustain} times: {proposal.detail}",
            )
            return keep, replace(memory, pending=key, num_pending=count)
        since = None if memory.changed_at_s is None else inputs.now_s - memory.changed_at_s
        if since is not None and since < config.min_dwell_s:
            keep = Decision(
                Action.KEEP,
                Reason.DWELL,
                memory.layout,
                f"{proposal.action.value} ({proposal.reason.value}) held: last change"
                f" {since:.1f} s ago < {config.min_dwell_s:g} s: {proposal.detail}",
            )
            return keep, replace(memory, pending=key, num_pending=count)
    reference = memory.split_prompt_tokens_per_s
    if proposal.action is Action.SPLIT:
        reference = inputs.figures.prompt_tokens_per_s
    elif proposal.action is Action.COLOCATE:
        reference = 0.0
    no_split_before = memory.no_split_before_s
    if proposal.reason is Reason.SPLIT_NOT_HELPING:
        no_split_before = inputs.now_s + config.split_backoff_s
    return proposal, AutoMemory(
        layout=proposal.layout,
        changed_at_s=inputs.now_s,
        split_prompt_tokens_per_s=reference,
        no_split_before_s=no_split_before,
    )


def _propose(
    memory: AutoMemory, inputs: AutoInputs, config: AutoConfig, slo: SLOConfig
) -> Decision:
    layout, f, n = memory.layout, inputs.figures, inputs.num_workers
    keep = Action.KEEP
    if not layout.split:
        if n < 2:
            return Decision(keep, Reason.TOO_FEW_WORKERS, layout, f"{n} worker(s) of role both")
        if inputs.breaker is BreakerHealth.OPEN:
            return Decision(keep, Reason.BREAKER_OPEN, layout, "KV-path breaker open")
        blocked = memory.no_split_before_s
        if blocked is not None and inputs.now_s < blocked:
            return Decision(
                keep,
                Reason.BACKOFF,
                layout,
                f"the last split did not help; none for {blocked - inputs.now_s:.0f} s more",
            )
        return _colocated(layout, inputs, config, slo)
    if inputs.breaker is BreakerHealth.OPEN:
        return Decision(Action.COLOCATE, Reason.BREAKER_OPEN, Layout(), "KV-path breaker open")
    if n < 2:
        return Decision(
            Action.COLOCATE, Reason.TOO_FEW_WORKERS, Layout(), f"{n} worker(s) of role both"
        )
    if layout.num_prefill > n - 1:
        p = n - 1
        return Decision(
            Action.RESIZE,
            Reason.TOO_FEW_WORKERS,
            Layout(p),
            f"{n} worker(s) of role both left for {layout.num_prefill} prefill -> {p}:1",
        )
    floor = config.low_water * memory.split_prompt_tokens_per_s
    if f.prompt_tokens_per_s < floor:
        return Decision(
            Action.COLOCATE,
            Reason.LOAD_FELL,
            Layout(),
            f"prompt tokens {f.prompt_tokens_per_s:.0f}/s < {config.low_water:g} x"
            f" {memory.split_prompt_tokens_per_s:.0f}/s at the split",
        )
    return _split(layout, inputs, config)


def _colocated(layout: Layout, inputs: AutoInputs, config: AutoConfig, slo: SLOConfig) -> Decision:
    f, keep = inputs.figures, Action.KEEP
    if f.num_requests < config.min_requests:
        return Decision(
            keep, Reason.FEW_SAMPLES, layout, f"{f.num_requests} requests ended in the window"
        )
    tpot = f"TPOT attainment {f.tpot_attainment:.2f} (target {config.target_attainment:g})"
    if f.tpot_attainment >= config.target_attainment:
        return Decision(keep, Reason.WITHIN_SLO, layout, tpot)
    with_, without = f.with_prefill, f.without_prefill
    if without.num_tokens < config.min_decode_tokens:
        return Decision(
            keep,
            Reason.FEW_SAMPLES,
            layout,
            f"{tpot}; {without.num_tokens} decode tokens without prefill"
            f" (need {config.min_decode_tokens})",
        )
    figures = (
        f"{tpot}; decode TPOT mean with prefill {_ms(with_.mean_s)} ({with_.num_tokens} tokens),"
        f" without {_ms(without.mean_s)} (SLO {_ms(slo.tpot_s)});"
        f" {f.num_tpot_missed_interfered} of {f.num_tpot_missed} misses interfered"
    )
    if without.mean_s > slo.tpot_s:
        return Decision(keep, Reason.DECODE_BOUND, layout, f"{figures}: decode alone misses it")
    if f.num_tpot_missed_interfered < config.interfered_share * f.num_tpot_missed:
        return Decision(keep, Reason.NOT_INTERFERENCE, layout, f"{figures}: prefill is not why")
    share = inputs.load.prefill_share
    p = prefill_count(inputs.num_workers, share)
    return Decision(
        Action.SPLIT,
        Reason.INTERFERENCE,
        Layout(p),
        f"{figures}; prefill share of busy time {share:.2f} -> {p}:{inputs.num_workers - p}",
    )


def _split(layout: Layout, inputs: AutoInputs, config: AutoConfig) -> Decision:
    f, keep = inputs.figures, Action.KEEP
    p, d = layout.num_prefill, inputs.num_workers - layout.num_prefill
    if f.num_requests < config.min_requests:
        return Decision(
            keep, Reason.FEW_SAMPLES, layout, f"{f.num_requests} requests ended in the window"
        )
    target = config.target_attainment
    ttft_ok, tpot_ok = f.ttft_attainment >= target, f.tpot_attainment >= target
    figures = (
        f"attainment TTFT {f.ttft_attainment:.2f}, TPOT {f.tpot_attainment:.2f} (target {target:g})"
    )
    if ttft_ok and tpot_ok:
        return Decision(keep, Reason.WITHIN_SLO, layout, figures)
    if not ttft_ok and tpot_ok:
        if d > 1:
            return Decision(
                Action.RESIZE, Reason.PREFILL_BOUND, Layout(p + 1), f"{figures} -> {p + 1}:{d - 1}"
            )
        return Decision(keep, Reason.AT_LIMIT, layout, f"{figures}; one decode worker left")
    if not tpot_ok and ttft_ok:
        if p > 1:
            return Decision(
                Action.RESIZE, Reason.DECODE_BOUND, Layout(p - 1), f"{figures} -> {p - 1}:{d + 1}"
            )
        return Decision(
            Action.COLOCATE,
            Reason.SPLIT_NOT_HELPING,
            Layout(),
            f"{figures}; one prefill worker left: every worker decodes again",
        )
    return Decision(keep, Reason.AT_LIMIT, layout, f"{figures}: both phases over their SLO")
