"""The Prometheus text format: histogram lines, label checks, parsing back."""

from __future__ import annotations

import math

import pytest

from pdserve.observability import metric_names as m
from pdserve.observability.exposition import (
    Histogram,
    parse,
    render_family,
    render_histograms,
    render_text,
    total,
)


def test_histogram_buckets_are_cumulative_and_a_bound_is_inclusive() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    assert h.buckets() == [("0.1", 2.0), ("1.0", 3.0), ("+Inf", 4.0)]
    text = render_text(render_histograms(m.WORKER_KV_SEND_SECONDS, [({"worker_id": "w"}, h)]))
    name = m.WORKER_KV_SEND_SECONDS.name
    assert {(s.name, s.label("le"), s.value) for s in parse(text)} == {
        (f"{name}_bucket", "0.1", 2.0),
        (f"{name}_bucket", "1.0", 3.0),
        (f"{name}_bucket", "+Inf", 4.0),
        (f"{name}_sum", None, 2.65),
        (f"{name}_count", None, 4.0),
    }
    assert h.quantile(0.5) == 0.1 and h.quantile(0.75) == 1.0 and h.quantile(1.0) == math.inf
    assert Histogram((1.0,)).quantile(0.5) is None


def test_a_family_with_other_labels_than_its_spec_is_refused() -> None:
    with pytest.raises(ValueError, match="pdserve_router_retries_total"):
        render_family(m.ROUTER_RETRIES, [({"why": "x"}, 1)])
    with pytest.raises(ValueError, match="pdserve_router_ttft_seconds"):
        render_histograms(m.ROUTER_TTFT, [({"worker_id": "w"}, Histogram((1.0,)))])


def test_rendered_text_parses_back_with_escaped_labels() -> None:
    lines = render_family(
        m.ROUTER_FALLBACKS, [({"reason": 'a "quoted"\\ \nreason'}, 3), ({"reason": "b"}, 0.5)]
    )
    samples = parse(render_text(lines))
    assert [(s.name, s.label("reason"), s.value) for s in samples] == [
        ("pdserve_router_fallbacks_total", 'a "quoted"\\ \nreason', 3.0),
        ("pdserve_router_fallbacks_total", "b", 0.5),
    ]
    assert total(samples, "pdserve_router_fallbacks_total") == 3.5
    assert total(samples, "pdserve_router_fallbacks_total", reason="b") == 0.5
    assert total(samples, "nothing") == 0


def test_a_malformed_line_is_named() -> None:
    with pytest.raises(ValueError, match="line 2"):
        parse("ok 1\nnot a sample at all\n")
