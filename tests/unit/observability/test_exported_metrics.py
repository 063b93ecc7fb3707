"""The exported series are pinned: every declared family, rendered through prometheus_client
with one labelled sample, has the HELP and TYPE lines and the series (names, labels, values)
recorded in data/exported_families.json, which was written by the hand-made renderer this
replaced. A renamed series, a changed type or help text, or a label lost fails here."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.observability import exposition as x
from pdserve.observability import metric_names as m

PINNED = Path(__file__).parent / "data" / "exported_families.json"


def exported() -> dict[str, dict[str, list[object]]]:
    out: dict[str, dict[str, list[object]]] = {}
    for spec in sorted(m.ALL, key=lambda s: s.name):
        labels = {k: f"v_{k}" for k in spec.labels}
        if spec.kind == "histogram":
            hist = x.Histogram(x.SECONDS_BUCKETS)
            for v in (0.003, 0.2, 7.0):
                hist.observe(v)
            text = x.render_text(x.render_histograms(spec, [(labels, hist)]))
        else:
            text = x.render_text(x.render_family(spec, [(labels, 3)]))
        meta = sorted(line for line in text.splitlines() if line.startswith(("# HELP", "# TYPE")))
        samples = sorted([s.name, sorted(s.labels), s.value] for s in x.parse(text))
        out[spec.name] = {"meta": meta, "samples": samples}
    return out


def test_every_family_exports_the_pinned_series() -> None:
    pinned = json.loads(PINNED.read_text())
    # JSON has lists where the render has tuples: compare through one round trip.
    now = json.loads(json.dumps(exported()))
    assert sorted(now) == sorted(pinned)
    assert [name for name in pinned if now[name] != pinned[name]] == []
