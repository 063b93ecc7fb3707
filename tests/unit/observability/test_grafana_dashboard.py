"""deploy/grafana/pdserve.json: valid JSON whose every PromQL query uses only metrics (and
labels) declared in `metric_names`, so a renamed metric cannot leave a panel silently empty."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from pdserve.observability import metric_names as m

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "pdserve.json"
_METRIC = re.compile(r"\bpdserve_[a-z0-9_]+\b")
_BY = re.compile(r"\bby\s*\(([^)]*)\)")
_MATCHER = re.compile(r"\{([^}]*)\}")
_LEGEND_LABEL = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")


def _targets() -> list[dict[str, Any]]:
    dashboard = json.loads(DASHBOARD.read_text())
    targets: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            targets += inner.get("targets", [])
    return targets


def _spec_of(series: str) -> m.MetricSpec:
    for spec in m.ALL:
        if series == spec.name or (
            spec.kind == "histogram"
            and series in {f"{spec.name}_{s}" for s in ("bucket", "sum", "count")}
        ):
            return spec
    raise AssertionError(f"{series} is not declared in metric_names")


def test_the_dashboard_has_panels_with_queries() -> None:
    assert len(_targets()) >= 25


@pytest.mark.parametrize("target", _targets(), ids=lambda t: str(t["expr"])[:60])
def test_every_query_uses_declared_metrics_and_labels(target: dict[str, Any]) -> None:
    expr = str(target["expr"])
    series = _METRIC.findall(expr)
    assert series, f"no pdserve metric in {expr!r}"
    assert set(series) <= m.SERIES, set(series) - m.SERIES
    specs = [_spec_of(s) for s in series]
    labels = {label for spec in specs for label in spec.labels}
    if any(s.endswith("_bucket") for s in series):
        labels.add("le")
    used = {
        name.strip() for group in _BY.findall(expr) for name in group.split(",") if name.strip()
    }
    used |= {
        part.split("=")[0].strip()
        for group in _MATCHER.findall(expr)
        for part in group.split(",")
        if part.strip()
    }
    assert used <= labels, f"{expr!r} uses labels {used - labels} its metrics do not have"
    # A legend may only name labels the query keeps.
    legend = set(_LEGEND_LABEL.findall(str(target.get("legendFormat", ""))))
    kept = used if _BY.search(expr) else labels
    assert legend <= kept, f"legend {target.get('legendFormat')!r} names labels not in {kept}"
