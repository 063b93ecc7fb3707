"""The router's live view of interference and SLOs: fed per chunk and per request by the
dispatcher's observed flow, read by /metrics, /health and the automatic mode.

It keeps, since start, the decode TPOT and decode step histograms labelled by whether prefill
shared the step (`prefill="with"|"without"`) and the requests per SLO outcome; and, over the
last `window_s`, the `InterferenceWindow` whose `LiveFigures` give the attainment gauges and
the automatic mode's inputs. The rules (which gap is a decode sample, what meets an SLO) are
`router/mode/interference.py`; this module only routes observations and renders them.
Not thread-safe: the router runs on one event loop.
"""

from __future__ import annotations

from collections import Counter

from prometheus_client.metrics_core import Metric

from pdserve.clock import Clock, MonotonicClock
from pdserve.observability import metric_names as m
from pdserve.observability.exposition import Histogram, render_family, render_histograms
from pdserve.observability.request_stats import RequestStats
from pdserve.protocol.worker_api import StepInfo
from pdserve.router.mode.interference import (
    DecodeTracker,
    InterferenceWindow,
    LiveFigures,
    SLOConfig,
    SLOOutcome,
    slo_outcome,
)

# Seconds per token: finer than the shared latency buckets where decode steps live (ms).
TPOT_BUCKETS = (
    0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
    0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
_LABELS = {True: "with", False: "without"}


class LiveMonitor:
    """Interference and SLO figures, cumulative and over the live window."""

    def __init__(self, slo: SLOConfig, window_s: float, clock: Clock | None = None) -> None:
        self.slo = slo
        self.clock = clock or MonotonicClock()
        self.window = InterferenceWindow(slo, window_s)
        self.decode_tpot = {k: Histogram(TPOT_BUCKETS) for k in _LABELS}
        self.decode_step = {k: Histogram(TPOT_BUCKETS) for k in _LABELS}
        self.outcomes: Counter[SLOOutcome] = Counter()

    def begin(self, num_prompt_tokens: int, max_tokens: int) -> DecodeTracker:
        """A request's flow starts; returns the tracker its chunks go through."""
        now = self.clock.now()
        self.window.add_arrival(now, num_prompt_tokens, max_tokens)
        return DecodeTracker(began_s=now)

    def chunk(
        self, tracker: DecodeTracker, step: StepInfo | None, gap_s: float | None, num_tokens: int
    ) -> None:
        """A chunk of `num_tokens` arrived `gap_s` seconds per token after the previous one."""
        if not tracker.classify(step, gap_s) or step is None or gap_s is None:
            return
        with_prefill = step.num_prefill_tokens > 0
        now = self.clock.now()
        for _ in range(num_tokens):
            self.decode_tpot[with_prefill].observe(gap_s)
            self.decode_step[with_prefill].observe(step.duration_s)
            self.window.add_decode_token(now, gap_s, with_prefill)

    def end(self, tracker: DecodeTracker, stats: RequestStats, finished: bool) -> SLOOutcome:
        """A request's flow ended; returns its SLO outcome."""
        outcome = slo_outcome(stats.ttft_s, stats.tpot_s, finished, self.slo)
        self.outcomes[outcome] += 1
        interfered = tracker.num_with_prefill > 0
        self.window.add_request(
            self.clock.now(), outcome, stats.tpot_s, interfered, began_s=tracker.began_s
        )
        return outcome

    def figures(self, since_s: float | None = None) -> LiveFigures:
        """The live window now (from `since_s` on, when given: monotonic seconds)."""
        return self.window.figures(self.clock.now(), since_s)

    def render(self) -> list[Metric]:
        """Prometheus lines of every family this monitor keeps."""
        lines: list[Metric] = []
        for spec, hists in (
            (m.ROUTER_DECODE_TPOT, self.decode_tpot),
            (m.ROUTER_DECODE_STEP, self.decode_step),
        ):
            lines += render_histograms(
                spec, [({"prefill": _LABELS[k]}, h) for k, h in hists.items()]
            )
        lines += render_family(
            m.ROUTER_SLO_REQUESTS, (({"outcome": o.value}, self.outcomes[o]) for o in SLOOutcome)
        )
        f = self.figures()
        lines += render_family(
            m.ROUTER_SLO_ATTAINMENT,
            (
                ({"slo": name}, value)
                for name, value in (
                    ("ttft", f.ttft_attainment),
                    ("tpot", f.tpot_attainment),
                    ("both", f.attainment),
                )
                if value == value  # NaN (no request in the window) is left out
            ),
        )
        lines += render_family(
            m.ROUTER_SLO_TARGET,
            [({"slo": "ttft"}, self.slo.ttft_s), ({"slo": "tpot"}, self.slo.tpot_s)],
        )
        return lines
