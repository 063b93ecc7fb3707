"""What `pdserve advise` concludes from its goodput curves. Pure: summaries in, advice out.

Arms: with N workers, `colocated` (every worker runs whole requests) and `disagg-P:D` for every
split P + D = N, P >= 1, D >= 1 (P workers prefill, D decode).

Per arm, the **sustained rate** is the highest measured rate at which SLO attainment reaches
the target and at every lower measured rate too (a curve that dips and recovers is not trusted
past the dip); 0 when even the lowest rate misses it.

The **recommendation** is the arm with the highest sustained rate; a tie goes to colocated
(the simpler deployment: no KV transfers, every worker does everything), then to the higher
goodput at the highest rate. When no arm sustains the lowest rate, the arm with the highest
goodput at the lowest rate is named, with `meets_slo` false: the workload needs more workers
or looser SLOs.

`goodput_ratio_disagg_vs_colocated`: per rate, the best split's goodput over colocated's (None
where colocated had no goodput): the figure that says how much the split buys, or costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.advise.goodput_stats import SLO, RateSummary

COLOCATED = "colocated"


@dataclass(frozen=True, slots=True)
class Arm:
    """One way of using the N workers."""

    # 0: colocated.
    num_prefill: int
    num_decode: int

    @property
    def split(self) -> bool:
        return self.num_prefill > 0

    @property
    def name(self) -> str:
        """The arm's label in reports: `colocated` or `disagg-P:D`."""
        return f"disagg-{self.num_prefill}:{self.num_decode}" if self.split else COLOCATED

    def to_dict(self) -> dict[str, object]:
        """The JSON form of the report: the name, then the worker counts."""
        return {"name": self.name, "num_prefill": self.num_prefill, "num_decode": self.num_decode}


def arms_for(num_workers: int) -> list[Arm]:
    """Colocated, then every P:D split of `num_workers`, fewest prefill workers first."""
    return [Arm(p, num_workers - p) for p in range(num_workers)]


def sustained_rate(summaries: Sequence[RateSummary], target: float) -> float:
    """The highest rate met with every lower rate (see the module docstring); 0 if none."""
    best = 0.0
    for s in sorted(summaries, key=lambda s: s.rate):
        if s.attainment < target:
            break
        best = s.rate
    return best


@dataclass(frozen=True, slots=True)
class Advice:
    """The recommendation and its evidence."""

    arm: Arm
    meets_slo: bool
    # arm name -> its sustained rate (requests/s).
    sustained: dict[str, float]
    # rate -> best split goodput / colocated goodput (None: colocated goodput 0).
    ratio_by_rate: dict[float, float | None]
    # The best split arm by sustained rate (then goodput), for the ratio line.
    best_split: Arm | None


def _goodput_at(summaries: Sequence[RateSummary], arm: str, rate: float) -> float:
    return next((s.goodput_rps for s in summaries if s.mode == arm and s.rate == rate), 0.0)


def advise(arms: Sequence[Arm], summaries: Sequence[RateSummary], target: float) -> Advice:
    """Pick the arm to run (see the module docstring)."""
    rates = sorted({s.rate for s in summaries})
    low, top = rates[0], rates[-1]
    sustained = {
        a.name: sustained_rate([s for s in summaries if s.mode == a.name], target) for a in arms
    }

    def key(a: Arm) -> tuple[float, bool, float]:
        return (sustained[a.name], not a.split, _goodput_at(summaries, a.name, top))

    best = max(arms, key=key)
    meets = sustained[best.name] > 0
    if not meets:
        best = max(arms, key=lambda a: (_goodput_at(summaries, a.name, low), not a.split))
    splits = [a for a in arms if a.split]
    best_split = max(splits, key=key) if splits else None
    ratios: dict[float, float | None] = {}
    for rate in rates:
        coloc = _goodput_at(summaries, COLOCATED, rate)
        split = max((_goodput_at(summaries, a.name, rate) for a in splits), default=0.0)
        ratios[rate] = split / coloc if coloc > 0 else None
    return Advice(best, meets, sustained, ratios, best_split)


def render_advice(advice: Advice, slo: SLO, target: float) -> str:
    """The recommendation in words, with the sustained rate of every arm and the ratios."""
    slos = f"TTFT <= {slo.ttft_s * 1e3:g} ms and TPOT <= {slo.tpot_s * 1e3:g} ms"
    arm = advice.arm
    shape = (
        f"{arm.num_prefill} prefill + {arm.num_decode} decode workers"
        if arm.split
        else f"{arm.num_decode} workers, each running whole requests"
    )
    lines = []
    if advice.meets_slo:
        lines.append(
            f"recommendation: {arm.name} ({shape}): sustains"
            f" {advice.sustained[arm.name]:g} req/s with >= {target:.0%} of requests within {slos}"
        )
    else:
        lines.append(
            f"recommendation: none of the arms keeps {target:.0%} of requests within {slos} even"
            f" at the lowest rate; {arm.name} ({shape}) has the most goodput there."
            " Add workers or loosen the SLOs."
        )
    for name, rate in advice.sustained.items():
        lines.append(f"  sustained within the SLOs: {name:<12} {rate:g} req/s")
    for rate, ratio in advice.ratio_by_rate.items():
        shown = "n/a (colocated goodput 0)" if ratio is None else f"{ratio:.2f}x"
        lines.append(f"  goodput at {rate:g} req/s: best split / colocated = {shown}")
    return "\n".join(lines)
