"""The arithmetic of `pdserve bench serve`: workload, SLO attainment, goodput. Pure: no I/O.

Workload: for one rate, request `i` arrives at `arrival_s[i]`, the running sum of exponential
gaps with mean 1/rate (a Poisson process), drawn from a `random.Random` seeded by the caller;
its prompt is `num_prompt_tokens` ids drawn uniformly from `VOCAB` and it asks for
`max_tokens` (greedy, ignore_eos, so it gets exactly that many). The same seed gives the same
workload to every mode: modes differ only in the cluster that serves it.

Per request (client side, seconds): TTFT = send → first token; e2e = send → end of stream;
TPOT = (e2e − TTFT) / (tokens − 1), undefined for fewer than two tokens (such a request meets
any TPOT SLO: it has no inter-token time to miss).

Per (mode, rate): a request *meets the SLOs* when it finished without error, TTFT ≤ the TTFT
SLO and TPOT ≤ the TPOT SLO. Attainment = requests meeting them / requests sent (a failed
request is a miss, never left out). Goodput = requests meeting them / the measured span (first
send → last end of stream); throughput = completed requests / the same span. Percentiles are
nearest-rank over completed requests (`observability.stats.percentile`), NaN when there are none.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.errors import ConfigError
from pdserve.observability.stats import percentile

# Ordinary token ids of the tiny model, clear of its special tokens (as `bench multiturn`).
VOCAB = (40, 2000)


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    """How big the requests are; bounds inclusive."""

    min_prompt_tokens: int = 32
    max_prompt_tokens: int = 512
    min_output_tokens: int = 8
    max_output_tokens: int = 64

    def __post_init__(self) -> None:
        for name in ("prompt", "output"):
            low = getattr(self, f"min_{name}_tokens")
            high = getattr(self, f"max_{name}_tokens")
            if not 1 <= low <= high:
                raise ConfigError(f"{name} tokens: need 1 <= min <= max, got {low}..{high}")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of the workload."""

    index: int
    # Seconds after the first send at which this request is sent.
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class SLO:
    """The latency targets a request must meet to count towards goodput (seconds)."""

    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ConfigError(f"SLOs must be > 0, got TTFT {self.ttft_s} s, TPOT {self.tpot_s} s")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as the client saw it."""

    index: int
    num_prompt_tokens: int
    num_tokens: int
    # None when no token arrived.
    ttft_s: float | None
    e2e_s: float
    error: str | None = None
    # The router's id (GET /debug/requests/{id}); None when the request never got one.
    request_id: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None below two tokens or on error."""
        if self.error is not None or self.ttft_s is None or self.num_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_tokens - 1)

    def meets(self, slo: SLO) -> bool:
        """Finished without error within both SLOs."""
        if self.error is not None or self.ttft_s is None or self.ttft_s > slo.ttft_s:
            return False
        tpot = self.tpot_s
        return tpot is None or tpot <= slo.tpot_s


@dataclass(frozen=True, slots=True)
class RateSummary:
    """The figures of one mode at one rate (latencies in ms, rates per second)."""

    mode: str
    rate: float
    num_requests: int
    num_errors: int
    num_meeting_slo: int
    span_s: float
    throughput_rps: float
    output_tokens_per_s: float
    attainment: float
    goodput_rps: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float


def poisson_arrivals(
    rate: float, rng: random.Random, num_requests: int | None, duration_s: float | None
) -> list[float]:
    """Arrival offsets (s) of a Poisson process at `rate`/s: `num_requests` of them, or every
    arrival before `duration_s` (at least one), exactly one of the two given."""
    if rate <= 0 or (num_requests is None) == (duration_s is None):
        raise ConfigError(f"poisson_arrivals: rate {rate} with one of num_requests/duration_s")
    if num_requests is not None:
        return list(itertools.accumulate(rng.expovariate(rate) for _ in range(num_requests)))
    assert duration_s is not None
    arrivals: list[float] = []
    at = rng.expovariate(rate)
    while at < duration_s or not arrivals:
        arrivals.append(at)
        at += rng.expovariate(rate)
    return arrivals


def build_workload(
    rate: float,
    seed: int,
    shape: WorkloadShape,
    num_requests: int | None = None,
    duration_s: float | None = None,
) -> list[RequestSpec]:
    """The seeded requests of one rate: arrivals first, then each request's sizes and ids."""
    rng = random.Random(seed)
    arrivals = poisson_arrivals(rate, rng, num_requests, duration_s)
    specs = []
    for index, arrival in enumerate(arrivals):
        n = rng.randint(shape.min_prompt_tokens, shape.max_prompt_tokens)
        prompt = tuple(rng.randrange(*VOCAB) for _ in range(n))
        max_tokens = rng.randint(shape.min_output_tokens, shape.max_output_tokens)
        specs.append(RequestSpec(index, arrival, prompt, max_tokens))
    return specs


def summarize(
    mode: str, rate: float, records: Sequence[RequestRecord], span_s: float, slo: SLO
) -> RateSummary:
    """The figures of one (mode, rate) run whose sends and streams spanned `span_s` seconds."""
    done = [r for r in records if r.error is None]
    ttfts = [r.ttft_s * 1e3 for r in done if r.ttft_s is not None]
    tpots = [t * 1e3 for r in done if (t := r.tpot_s) is not None]
    e2es = [r.e2e_s * 1e3 for r in done]
    num_meeting = sum(r.meets(slo) for r in records)
    per_s = 1.0 / span_s if span_s > 0 else 0.0
    return RateSummary(
        mode=mode,
        rate=rate,
        num_requests=len(records),
        num_errors=len(records) - len(done),
        num_meeting_slo=num_meeting,
        span_s=span_s,
        throughput_rps=len(done) * per_s,
        output_tokens_per_s=sum(r.num_tokens for r in done) * per_s,
        attainment=num_meeting / len(records) if records else 0.0,
        goodput_rps=num_meeting * per_s,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        tpot_p50_ms=percentile(tpots, 50),
        tpot_p99_ms=percentile(tpots, 99),
        e2e_p50_ms=percentile(e2es, 50),
        e2e_p99_ms=percentile(e2es, 99),
    )


def goodput_ratios(
    summaries: Sequence[RateSummary], numerator: str = "disagg", denominator: str = "colocated"
) -> dict[float, float | None]:
    """numerator goodput / denominator goodput per rate both ran; None where the denominator
    had no goodput (a ratio over zero says nothing)."""
    by_key = {(s.mode, s.rate): s for s in summaries}
    ratios: dict[float, float | None] = {}
    for (mode, rate), top in by_key.items():
        bottom = by_key.get((denominator, rate))
        if mode != numerator or bottom is None:
            continue
        ratios[rate] = top.goodput_rps / bottom.goodput_rps if bottom.goodput_rps > 0 else None
    return ratios


def cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """(sorted values, fraction of values ≤ each): the empirical CDF's steps."""
    ordered = sorted(v for v in values if not math.isnan(v))
    n = len(ordered)
    return ordered, [(i + 1) / n for i in range(n)]


def representative(records: Sequence[RequestRecord]) -> RequestRecord | None:
    """The completed request whose e2e is the median's (nearest rank), for a phase breakdown."""
    done = sorted((r for r in records if r.error is None), key=lambda r: (r.e2e_s, r.index))
    return done[max(0, math.ceil(len(done) / 2) - 1)] if done else None


def render_table(summaries: Sequence[RateSummary], slo: SLO) -> str:
    """One row per (mode, rate)."""
    head = (
        f"{'mode':<10} {'rate':>5} {'sent':>4} {'err':>3} {'thru/s':>6} {'good/s':>6}"
        f" {'attain':>6} {'TTFT p50':>8} {'TTFT p99':>8} {'TPOT p50':>8} {'TPOT p99':>8}"
    )
    lines = [head, "-" * len(head)]
    for s in summaries:
        lines.append(
            f"{s.mode:<10} {s.rate:>5g} {s.num_requests:>4} {s.num_errors:>3}"
            f" {s.throughput_rps:>6.2f} {s.goodput_rps:>6.2f} {s.attainment:>6.2f}"
            f" {s.ttft_p50_ms:>8.0f} {s.ttft_p99_ms:>8.0f} {s.tpot_p50_ms:>8.1f}"
            f" {s.tpot_p99_ms:>8.1f}"
        )
    lines.append(
        f"latencies in ms; SLOs: TTFT <= {slo.ttft_s * 1e3:g} ms and TPOT <= {slo.tpot_s * 1e3:g}"
        " ms; good/s = requests/s meeting both; attain = fraction of requests sent meeting both"
    )
    return "\n".join(lines)
