"""The type of a metric declaration (`MetricSpec`) and the helper that builds one, shared by
the modules that declare metrics (`metric_names`, `checkpoint_metric_names`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric family."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()


def spec(name: str, kind: Kind, help_text: str, *labels: str) -> MetricSpec:
    """One metric family's declaration."""
    return MetricSpec(name, kind, help_text, labels)


# The label every worker metric carries.
WORKER_LABELS = ("worker_id",)
