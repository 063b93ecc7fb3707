"""Prometheus metrics rendered and parsed by `prometheus_client`, from the spec table.

Every family is built from its `MetricSpec` (`metric_names`), so nothing is exported under a
name that is not declared there; a sample whose label names differ from the spec's raises
ValueError (a programming error, caught by the unit tests). The values stay with their owners
(counters, `Histogram`s) and are read at scrape time into the library's metric families, which
`render_text` writes in the text format (0.0.4); `parse` reads a scrape back (`pdserve top`, the
tests that compare metrics with timelines). Not thread-safe: each process renders from its
event loop.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families

from pdserve.observability.metric_spec import MetricSpec

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: latency buckets shared by every duration histogram (+Inf is implicit).
SECONDS_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# Bytes: 4 KiB .. 4 GiB by powers of four.
BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(1, 12))
# 10^9 bytes per second.
GBPS_BUCKETS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)

Labels = Mapping[str, str]


@dataclass(slots=True)
class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics: a value equal to a bound is in it);
    of durations in seconds unless given other `bounds`."""

    bounds: tuple[float, ...] = SECONDS_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    num: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        """Record one value."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.num += 1

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding quantile `q` (None if empty; inf past the
        last bound). Coarse by design: it is for `pdserve top`, not for reports."""
        if self.num == 0:
            return None
        rank, running = q * self.num, 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += count
            if running >= rank:
                return bound
        return math.inf

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative (le, count) pairs, +Inf last, as the exposition format has them."""
        pairs, running = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += count
            pairs.append(("+Inf" if bound == math.inf else repr(bound), float(running)))
        return pairs


def _check(spec: MetricSpec, labels: Labels) -> None:
    if tuple(labels) != spec.labels:
        raise ValueError(f"{spec.name}: labels {tuple(labels)} differ from {spec.labels}")


def render_family(spec: MetricSpec, samples: Iterable[tuple[Labels, float]]) -> list[Metric]:
    """A counter or gauge family with one sample per (labels, value)."""
    kind = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
    family = kind(spec.name, spec.help, labels=spec.labels)
    for labels, value in samples:
        _check(spec, labels)
        family.add_metric(list(labels.values()), float(value))
    return [family]


def by_label(base: Labels, label: str, counts: Mapping[str, float]) -> list[tuple[Labels, float]]:
    """One sample per key of `counts` (a Counter of reasons, errors...), labelled `label`."""
    return [({**base, label: key}, n) for key, n in sorted(counts.items())]


def render_histograms(spec: MetricSpec, series: Iterable[tuple[Labels, Histogram]]) -> list[Metric]:
    """A histogram family with each labelled histogram's buckets, sum and count."""
    family = HistogramMetricFamily(spec.name, spec.help, labels=spec.labels)
    for labels, hist in series:
        _check(spec, labels)
        family.add_metric(list(labels.values()), hist.buckets(), sum_value=hist.total)
    return [family]


def render_values(labels: Labels, values: Iterable[tuple[MetricSpec, float]]) -> list[Metric]:
    """One single-sample family per (spec, value), every sample labelled `labels`."""
    return [family for spec, value in values for family in render_family(spec, [(labels, value)])]


def render_each_histogram(
    labels: Labels, series: Iterable[tuple[MetricSpec, Histogram]]
) -> list[Metric]:
    """One histogram family per (spec, histogram), every one labelled `labels`."""
    return [family for spec, hist in series for family in render_histograms(spec, [(labels, hist)])]


@dataclass(frozen=True, slots=True)
class _Families:
    """What `generate_latest` collects from: the families of one scrape."""

    families: Sequence[Metric]

    def collect(self) -> Iterable[Metric]:
        return self.families


def render_text(families: Sequence[Metric]) -> str:
    """The families in the Prometheus text format (0.0.4)."""
    return generate_latest(_Families(families)).decode()


@dataclass(frozen=True, slots=True)
class Sample:
    """One parsed sample."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


def parse(text: str) -> list[Sample]:
    """Every sample of an exposition text; ValueError naming the first malformed line."""
    try:
        return [
            Sample(s.name, tuple(s.labels.items()), float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]
    except ValueError:
        # The library names no line: find it, so a bad scrape says where it went wrong.
        for lineno, raw in enumerate(text.splitlines(), 1):
            try:
                list(text_string_to_metric_families(raw + "\n"))
            except ValueError as exc:
                raise ValueError(f"line {lineno}: not a sample: {raw!r} ({exc})") from None
        raise


def total(samples: Iterable[Sample], name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels` (0 if none)."""
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.label(k) == v for k, v in labels.items())
    )
