"""Spike detection on handoff phases: a rolling, robust baseline per phase. Pure.

A sample is a spike when it exceeds both `median + k * 1.4826 * MAD` of the phase's last
`window` samples and `min_ratio * median`: the MAD term adapts to each phase's own noise, the
ratio keeps a phase with near-zero spread (MAD ~ 0) from flagging every jitter. The median and
MAD ignore the outliers they are meant to find, unlike a mean and standard deviation, so one
spike does not hide the next. Nothing is flagged before `min_samples` samples.

Spikes are counted per phase and returned with the request id, the value and the baseline, so
the caller can log them and export the counts.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Spike:
    """One phase of one request that took far longer than its baseline."""

    request_id: str
    phase: str
    value_s: float
    median_s: float
    threshold_s: float

    def describe(self) -> str:
        """One log line: which request, which phase, how far over."""
        ratio = self.value_s / self.median_s if self.median_s > 0 else float("inf")
        return (
            f"handoff spike: request {self.request_id} phase {self.phase} took"
            f" {self.value_s * 1e3:.1f} ms, {ratio:.1f}x its median {self.median_s * 1e3:.1f} ms"
            f" (threshold {self.threshold_s * 1e3:.1f} ms)"
        )


@dataclass(slots=True)
class SpikeDetector:
    """Rolling median/MAD baselines per phase; `observe` returns the spikes a request caused."""

    window: int = 200
    k: float = 5.0
    min_ratio: float = 2.0
    min_samples: int = 20
    counts: Counter[str] = field(default_factory=Counter)
    _samples: dict[str, deque[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.window < 2 or not 2 <= self.min_samples <= self.window:
            raise ValueError(
                f"need 2 <= min_samples <= window, got {self.min_samples}, {self.window}"
            )
        if self.k <= 0 or self.min_ratio < 1:
            raise ValueError(f"need k > 0 and min_ratio >= 1, got {self.k}, {self.min_ratio}")

    def threshold(self, phase: str) -> tuple[float, float] | None:
        """(median, threshold) of the phase now; None while it has too few samples."""
        samples = self._samples.get(phase)
        if samples is None or len(samples) < self.min_samples:
            return None
        median = statistics.median(samples)
        mad = statistics.median(abs(x - median) for x in samples)
        return median, max(median + self.k * 1.4826 * mad, self.min_ratio * median)

    def observe(self, request_id: str, phases: dict[str, float]) -> list[Spike]:
        """Check each phase against its baseline, then add it to the baseline."""
        spikes: list[Spike] = []
        for phase, value in phases.items():
            baseline = self.threshold(phase)
            if baseline is not None and value > baseline[1]:
                spikes.append(Spike(request_id, phase, value, baseline[0], baseline[1]))
                self.counts[phase] += 1
            self._samples.setdefault(phase, deque(maxlen=self.window)).append(value)
        return spikes
