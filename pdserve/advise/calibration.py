"""SLOs and rates as multiples of what this machine does with a lone request.

Absolute SLOs chosen on one machine mean nothing on another: on a machine 3x slower, a 10 ms
TPOT SLO is out of reach for every arm, and `advise` recommends whatever fails least. So the
SLOs (and the offered rates) may be given relative to a lone request of the workload, measured
first on the same cluster: `--slo-ttft-x 10` is ten times a lone request's TTFT, `--rates-x
0.5,1,2` offers half, one and two times the rate one lone request after another would run at
(1 / its end-to-end latency). The conversion is pure (`calibrated`); the measurement
(`measure_lone`) sends `repeats` lone requests after one warm-up and takes medians.
"""

from __future__ import annotations

import statistics
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from pdserve.advise.flags import checked, integer, positive, positive_floats
from pdserve.advise.goodput_stats import SLO
from pdserve.errors import ConfigError
from pdserve.settings import Flag, flag

# The --help group of `Relative`'s flags.
CALIBRATION = (
    "calibrated SLOs and rates: multiples of a lone request of the workload, measured first"
)


def _multiple(name: str, slo: str) -> dict[str, Flag]:
    """The metadata of a `Relative` field declaring `--name`: the `slo` SLO as a multiple of a
    lone request's."""
    return flag(
        name=name,
        type=str,
        check=lambda flag_name, text: positive(flag_name, text, 1e6),
        group=CALIBRATION,
        help=f"{slo} SLO as a multiple of a lone request's",
    )


@dataclass(frozen=True, slots=True)
class Relative:
    """SLOs and rates as multiples of a lone request's figures."""

    # Given all three or none (`advise.command._relative`).
    ttft_x: float = field(metadata=_multiple("slo-ttft-x", "TTFT"))
    tpot_x: float = field(metadata=_multiple("slo-tpot-x", "TPOT"))
    rates_x: tuple[float, ...] = field(
        metadata=flag(
            type=str,
            check=lambda name, text: positive_floats(name, text, 1e4),
            group=CALIBRATION,
            help="comma-separated rates as multiples of 1 / a lone request's end-to-end time",
        )
    )
    # Lone requests measured (after one warm-up); their medians are the unit.
    repeats: int = checked(
        5,
        lambda name, text: integer(name, text, 1, 100),
        name="calibration-repeats",
        group=CALIBRATION,
        help="lone requests measured (medians)",
    )

    def __post_init__(self) -> None:
        if not (self.ttft_x > 0 and self.tpot_x > 0 and self.rates_x):
            raise ConfigError(f"calibration: multiples must be > 0, got {self}")
        if not all(r > 0 for r in self.rates_x):
            raise ConfigError(f"--rates-x: multiples must be > 0, got {self.rates_x}")
        if self.repeats < 1:
            raise ConfigError(f"--calibration-repeats: must be >= 1, got {self.repeats}")


@dataclass(frozen=True, slots=True)
class Lone:
    """A lone request of the workload on this machine (medians)."""

    ttft_s: float
    tpot_s: float
    # Output tokens of the request measured (its end-to-end time is TTFT + TPOT * (n - 1)).
    num_output_tokens: int

    @property
    def e2e_s(self) -> float:
        return self.ttft_s + self.tpot_s * max(0, self.num_output_tokens - 1)


def calibrated(lone: Lone, relative: Relative) -> tuple[SLO, tuple[float, ...]]:
    """The absolute SLOs and rates (requests/s) `relative` stands for on this machine."""
    if not (lone.ttft_s > 0 and lone.tpot_s > 0):
        raise ConfigError(f"calibration: a lone request measured nothing usable: {lone}")
    slo = SLO(ttft_s=relative.ttft_x * lone.ttft_s, tpot_s=relative.tpot_x * lone.tpot_s)
    rates = tuple(round(x / lone.e2e_s, 3) for x in relative.rates_x)
    return slo, rates


# One lone request: (TTFT s, TPOT s) as the client saw them, or None if it failed.
LoneRequest = Callable[[], Awaitable[tuple[float, float] | None]]


async def measure_lone(send: LoneRequest, repeats: int, num_output_tokens: int) -> Lone:
    """Medians over `repeats` lone requests sent one after another (one warm-up first)."""
    await send()
    figures: list[tuple[float, float]] = []
    for _ in range(repeats):
        got = await send()
        if got is not None:
            figures.append(got)
    if not figures:
        raise ConfigError("calibration: every lone request failed; see the workers' logs")
    return Lone(
        ttft_s=statistics.median(f[0] for f in figures),
        tpot_s=statistics.median(f[1] for f in figures),
        num_output_tokens=num_output_tokens,
    )


def tpot_of(ttft_s: float | None, latency_s: float, num_tokens: int) -> float | None:
    """A request's mean time per output token after the first (None: fewer than 2 tokens)."""
    if ttft_s is None or num_tokens < 2:
        return None
    return (latency_s - ttft_s) / (num_tokens - 1)


def middle(values: Sequence[int]) -> int:
    """The middle of a length range or trace: the lone request's size."""
    return int(statistics.median_low(values))
