"""The Prometheus text exposition format (version 0.0.4): histograms, rendering and parsing.

Rendering takes a `MetricSpec` from `metric_names` for every family, so nothing is exported
under a name that is not declared there; a sample whose label names differ from the spec's
raises ValueError (a programming error, caught by the unit tests). Parsing is the inverse, used
by `pdserve top` and by tests that compare metrics with timelines. Pure: no I/O, no client
library; not thread-safe (each process renders from its event loop).
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

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
    """Cumulative-bucket histogram (Prometheus semantics: a value equal to a bound is in it)."""

    bounds: tuple[float, ...]
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

    def render(self, name: str, labels: Labels | None = None) -> list[str]:
        """The `_bucket`, `_sum` and `_count` lines."""
        base = dict(labels or {})
        lines, running = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += count
            le = "+Inf" if bound == math.inf else repr(bound)
            lines.append(sample_line(f"{name}_bucket", {**base, "le": le}, running))
        lines += [
            sample_line(f"{name}_sum", base, self.total),
            sample_line(f"{name}_count", base, self.num),
        ]
        return lines


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return str(int(value))
    return repr(float(value))


def sample_line(name: str, labels: Labels, value: float) -> str:
    """`name{k="v",...} value`."""
    if not labels:
        return f"{name} {_number(value)}"
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {_number(value)}"


def _header(spec: MetricSpec) -> list[str]:
    return [f"# HELP {spec.name} {spec.help}", f"# TYPE {spec.name} {spec.kind}"]


def _check(spec: MetricSpec, labels: Labels) -> None:
    if tuple(labels) != spec.labels:
        raise ValueError(f"{spec.name}: labels {tuple(labels)} differ from {spec.labels}")


def render_family(spec: MetricSpec, samples: Iterable[tuple[Labels, float]]) -> list[str]:
    """A counter or gauge family: its header and one line per (labels, value)."""
    lines = _header(spec)
    for labels, value in samples:
        _check(spec, labels)
        lines.append(sample_line(spec.name, labels, value))
    return lines


def by_label(base: Labels, label: str, counts: Mapping[str, float]) -> list[tuple[Labels, float]]:
    """One sample per key of `counts` (a Counter of reasons, errors...), labelled `label`."""
    return [({**base, label: key}, n) for key, n in sorted(counts.items())]


def render_histograms(spec: MetricSpec, series: Iterable[tuple[Labels, Histogram]]) -> list[str]:
    """A histogram family: its header and each labelled histogram's lines."""
    lines = _header(spec)
    for labels, hist in series:
        _check(spec, labels)
        lines += hist.render(spec.name, labels)
    return lines


@dataclass(frozen=True, slots=True)
class Sample:
    """One parsed line."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse(text: str) -> list[Sample]:
    """Every sample line of an exposition text; ValueError naming a malformed line."""
    samples: list[Sample] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise ValueError(f"line {lineno}: not a sample: {raw!r}")
        name, body, value = match.groups()
        labels: list[tuple[str, str]] = []
        pos = 0
        while body is not None and pos < len(body):
            label = _LABEL.match(body, pos)
            if label is None:
                raise ValueError(f"line {lineno}: bad labels: {raw!r}")
            labels.append((label.group(1), _unescape(label.group(2))))
            pos = label.end()
        samples.append(Sample(name, tuple(labels), float(value)))
    return samples


def total(samples: Iterable[Sample], name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels` (0 if none)."""
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.label(k) == v for k, v in labels.items())
    )
