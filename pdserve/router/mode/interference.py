"""Prefill-decode interference and SLO attainment as the router measures them live. Pure.

Per decode token. A worker stream's `TokenEvent` carries the engine step that produced it
(`StepInfo`). A token counts as a **decode token** when its own slice in that step was a
decode slice and the request's previous token came from the same kind of stream (so the gap
is one decode step as the client sees it, not a handoff or a recompute). Its gap at the router
(time since the request's previous token) is its TPOT sample, labelled **with prefill** when
prefill tokens shared that step's batch, else **without**: in colocated mode the two figures
side by side are the interference; when split, decode workers only ever run decode steps.
`DecodeTracker` applies that rule to one request's chunks.

Per request. When its flow ends, a request is checked against the SLOs (TTFT and TPOT, as
`request_stats` computes them) and counted met / missed / failed, and remembered as
**interfered** when at least one of its decode tokens shared a step with prefill: a TPOT miss
of an interfered request is one prefill may have caused, the others it did not.

`InterferenceWindow` keeps the last `window_s` seconds of both, plus arrivals (prompt and
output tokens asked for), and summarises them as `LiveFigures`: the input of the auto mode's
decision (`pdserve.router.mode.auto_mode`) and of the SLO attainment gauges. Time is passed in
(seconds of one monotonic clock), never read here.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.errors import ConfigError
from pdserve.observability.stats import percentile
from pdserve.settings import setting

if TYPE_CHECKING:
    # Type only: the protocol module pulls in torch, and `router.flags` (light) imports this.
    from pdserve.protocol.worker_api import StepInfo


def _seconds(ms: float) -> float:
    return ms / 1e3


def _millis(seconds: float) -> float:
    return seconds * 1e3


@dataclass(frozen=True, slots=True)
class SLOConfig:
    """The latency targets a request must meet (seconds)."""

    ttft_s: float = setting(1.0, name="slo-ttft-ms", to_field=_seconds, to_flag=_millis)
    tpot_s: float = setting(0.05, name="slo-tpot-ms", to_field=_seconds, to_flag=_millis)

    def __post_init__(self) -> None:
        for name, value in (("--slo-ttft-ms", self.ttft_s), ("--slo-tpot-ms", self.tpot_s)):
            if not (math.isfinite(value) and 0 < value <= 3600):
                raise ConfigError(
                    f"{name}: must be > 0 and at most 3600000 ms, got {value * 1e3:g}"
                )


class SLOOutcome(enum.Enum):
    """How one request ended against the SLOs."""

    MET = "met"
    MISSED_TTFT = "missed_ttft"
    MISSED_TPOT = "missed_tpot"
    MISSED_BOTH = "missed_both"
    # No answer at all (error, no capacity, client gone before the end).
    FAILED = "failed"


def slo_outcome(
    ttft_s: float | None, tpot_s: float | None, finished: bool, slo: SLOConfig
) -> SLOOutcome:
    """A request's outcome; a finished request with fewer than two tokens has no TPOT to miss."""
    if not finished or ttft_s is None:
        return SLOOutcome.FAILED
    ttft_bad = ttft_s > slo.ttft_s
    tpot_bad = tpot_s is not None and tpot_s > slo.tpot_s
    if ttft_bad and tpot_bad:
        return SLOOutcome.MISSED_BOTH
    if ttft_bad:
        return SLOOutcome.MISSED_TTFT
    return SLOOutcome.MISSED_TPOT if tpot_bad else SLOOutcome.MET


class DecodeTracker:
    """One request's token chunks in order: which of their gaps are decode TPOT samples."""

    def __init__(self, began_s: float | None = None) -> None:
        # When the request arrived (monotonic seconds), for judging a layout by the requests
        # that began under it.
        self.began_s = began_s
        self._previous_from_stream = False
        # Decode tokens of this request whose step carried prefill tokens.
        self.num_with_prefill = 0

    def classify(self, step: StepInfo | None, gap_s: float | None) -> bool:
        """True when this chunk's gap (seconds per token) is a decode TPOT sample."""
        counted = (
            gap_s is not None and step is not None and step.decode and self._previous_from_stream
        )
        self._previous_from_stream = step is not None
        if counted and step is not None and step.num_prefill_tokens > 0:
            self.num_with_prefill += 1
        return counted


@dataclass(frozen=True, slots=True)
class _Token:
    at_s: float
    gap_s: float
    with_prefill: bool


@dataclass(frozen=True, slots=True)
class _Done:
    at_s: float
    outcome: SLOOutcome
    tpot_s: float | None
    interfered: bool
    began_s: float | None


@dataclass(frozen=True, slots=True)
class _Arrival:
    at_s: float
    num_prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class DecodeFigures:
    """Decode TPOT samples of one label in the window (seconds; NaN when none)."""

    num_tokens: int
    mean_s: float
    p50_s: float
    p90_s: float


@dataclass(frozen=True, slots=True)
class LiveFigures:
    """The router's window, summarised."""

    window_s: float
    # Decode tokens whose step carried prefill tokens, and those whose step did not.
    with_prefill: DecodeFigures
    without_prefill: DecodeFigures
    # Requests that ended in the window, and the fraction meeting each SLO (NaN when none).
    num_requests: int
    ttft_attainment: float
    tpot_attainment: float
    attainment: float
    # Request TPOT p90 over finished requests with a TPOT (seconds; NaN when none).
    request_tpot_p90_s: float
    # Requests that missed the TPOT SLO, and those of them whose decode shared a step with
    # prefill at least once (the misses prefill may have caused).
    num_tpot_missed: int
    num_tpot_missed_interfered: int
    # Arrivals in the window: requests, prompt tokens and output tokens asked for, per second.
    arrival_rate: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float

    @property
    def mixed_fraction(self) -> float:
        """Fraction of decode tokens that shared their step with prefill (NaN when none)."""
        n = self.with_prefill.num_tokens + self.without_prefill.num_tokens
        return self.with_prefill.num_tokens / n if n else math.nan


def _decode_figures(gaps: list[float]) -> DecodeFigures:
    if not gaps:
        return DecodeFigures(0, math.nan, math.nan, math.nan)
    return DecodeFigures(
        len(gaps), sum(gaps) / len(gaps), percentile(gaps, 50), percentile(gaps, 90)
    )


class InterferenceWindow:
    """The last `window_s` seconds of decode tokens, request outcomes and arrivals."""

    def __init__(self, slo: SLOConfig, window_s: float = 10.0, max_tokens: int = 100_000) -> None:
        if not window_s > 0:
            raise ConfigError(f"window: must be > 0 s, got {window_s}")
        self.slo = slo
        self.window_s = window_s
        # Bounded: under a flood of tokens the window holds the newest `max_tokens`.
        self._tokens: deque[_Token] = deque(maxlen=max_tokens)
        self._done: deque[_Done] = deque(maxlen=max_tokens)
        self._arrivals: deque[_Arrival] = deque(maxlen=max_tokens)

    def add_decode_token(self, at_s: float, gap_s: float, with_prefill: bool) -> None:
        """One decode TPOT sample (see `DecodeTracker`)."""
        self._tokens.append(_Token(at_s, gap_s, with_prefill))

    def add_request(
        self,
        at_s: float,
        outcome: SLOOutcome,
        tpot_s: float | None,
        interfered: bool = False,
        began_s: float | None = None,
    ) -> None:
        """A request whose flow ended at `at_s` (`interfered`: a decode token of it shared a
        step with prefill; `began_s`: when it arrived, if known)."""
        self._done.append(_Done(at_s, outcome, tpot_s, interfered, began_s))

    def add_arrival(self, at_s: float, num_prompt_tokens: int, max_tokens: int) -> None:
        """A request began."""
        self._arrivals.append(_Arrival(at_s, num_prompt_tokens, max_tokens))

    def _prune(self, now_s: float) -> None:
        horizon = now_s - self.window_s
        for q in (self._tokens, self._done, self._arrivals):
            while q and q[0].at_s < horizon:
                q.popleft()

    def figures(self, now_s: float, since_s: float | None = None) -> LiveFigures:
        """The window ending at `now_s`; with `since_s`, only what happened from then on (the
        automatic mode judges a layout by figures measured since it took effect): requests
        count only if they also began then, since one that crossed the change ran partly
        under the old layout (a colocated request that ends just after a split carries the
        interference the split is meant to remove)."""
        self._prune(now_s)
        start = now_s - self.window_s if since_s is None else max(now_s - self.window_s, since_s)
        tokens = [t for t in self._tokens if t.at_s >= start]
        arrivals = [a for a in self._arrivals if a.at_s >= start]
        with_gaps = [t.gap_s for t in tokens if t.with_prefill]
        without_gaps = [t.gap_s for t in tokens if not t.with_prefill]
        done = [
            d
            for d in self._done
            if d.at_s >= start and (since_s is None or d.began_s is None or d.began_s >= since_s)
        ]
        n = len(done)

        def share(ok: set[SLOOutcome]) -> float:
            return sum(d.outcome in ok for d in done) / n if n else math.nan

        ttft_ok = {SLOOutcome.MET, SLOOutcome.MISSED_TPOT}
        tpot_ok = {SLOOutcome.MET, SLOOutcome.MISSED_TTFT}
        tpots = [d.tpot_s for d in done if d.tpot_s is not None]
        missed = [d for d in done if d.outcome not in tpot_ok]
        # Rates over the part of the window the figures cover (at least a millisecond).
        span = max(1e-3, now_s - start)
        return LiveFigures(
            window_s=span,
            with_prefill=_decode_figures(with_gaps),
            without_prefill=_decode_figures(without_gaps),
            num_requests=n,
            ttft_attainment=share(ttft_ok),
            tpot_attainment=share(tpot_ok),
            attainment=share({SLOOutcome.MET}),
            request_tpot_p90_s=percentile(tpots, 90),
            num_tpot_missed=len(missed),
            num_tpot_missed_interfered=sum(d.interfered for d in missed),
            arrival_rate=len(arrivals) / span,
            prompt_tokens_per_s=sum(a.num_prompt_tokens for a in arrivals) / span,
            output_tokens_per_s=sum(a.max_tokens for a in arrivals) / span,
        )
