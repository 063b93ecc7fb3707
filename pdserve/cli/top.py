"""`pdserve top`: a live terminal view of a cluster, refreshed every `--interval` seconds.

Each frame is `pdserve status` (workers, roles, groups, blocks, load, breaker, mode) followed
by the router's request figures from its /metrics: totals, rates since the previous frame,
TTFT / handoff-gap / TPOT quantiles (bucket upper bounds, so coarse), retries, fallbacks and
migrations; then interference (decode TPOT of tokens whose engine step carried prefill
tokens against those whose step did not: exact means, bucket quantiles), SLO attainment over
the router's live window, and the automatic mode's layout and decisions. Plain ANSI: the screen is cleared and redrawn (`--once` prints one frame without
escape codes, for scripts and tests). Rendering a frame is pure; `run_top` does the I/O.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO
from urllib.error import URLError
from urllib.request import Request, urlopen

from pdserve.auth.keys import KeyKind, load_key
from pdserve.cli.command import run
from pdserve.cli.dial import add_tls_flags, dial_with_tls
from pdserve.cli.status import (
    ClusterStatus,
    StatusError,
    collect_status,
    find_router_url,
    render_table,
)
from pdserve.flag_types import positive_float
from pdserve.observability import metric_names as m
from pdserve.observability.exposition import Sample, parse, total

CLEAR = "\x1b[H\x1b[2J"


def histogram_quantile(samples: Sequence[Sample], name: str, q: float) -> float | None:
    """The upper bound of the bucket holding quantile `q` of histogram `name` (None: empty)."""
    buckets = sorted(
        (math.inf if s.label("le") == "+Inf" else float(s.label("le") or "nan"), s.value)
        for s in samples
        if s.name == f"{name}_bucket"
    )
    count = buckets[-1][1] if buckets else 0.0
    if count <= 0:
        return None
    for bound, cumulative in buckets:
        if cumulative >= q * count:
            return bound
    return math.inf


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return ">max" if value == math.inf else f"≤{value * 1e3:g}ms"


def render_metrics(
    samples: Sequence[Sample], previous: Sequence[Sample] | None, interval_s: float
) -> list[str]:
    """The request lines of a frame from the router's parsed /metrics."""
    requests = m.ROUTER_REQUESTS.name
    ok = total(samples, requests, status="ok")
    done = total(samples, requests)
    rate = "-"
    if previous is not None and interval_s > 0:
        rate = f"{(done - total(previous, requests)) / interval_s:.1f}/s"
    lines = [f"requests {done:g} (ok {ok:g}, other {done - ok:g})  rate {rate}"]
    for label, spec in (
        ("ttft", m.ROUTER_TTFT),
        ("handoff gap", m.ROUTER_HANDOFF_GAP),
        ("tpot", m.ROUTER_TPOT),
        ("transfer", m.ROUTER_TRANSFER),
    ):
        p50 = histogram_quantile(samples, spec.name, 0.5)
        p95 = histogram_quantile(samples, spec.name, 0.95)
        count = total(samples, f"{spec.name}_count")
        lines.append(f"{label:<12} p50 {_ms(p50):>10}  p95 {_ms(p95):>10}  n {count:g}")

    def by_reason(spec: m.MetricSpec) -> str:
        parts = [
            f"{s.label('reason')}={s.value:g}" for s in samples if s.name == spec.name and s.value
        ]
        return ", ".join(parts) or "0"

    lines.append(
        f"retries {by_reason(m.ROUTER_RETRIES)}  fallbacks {by_reason(m.ROUTER_FALLBACKS)}"
        f"  migrations {total(samples, m.ROUTER_MIGRATIONS.name):g}"
    )
    return lines


def _labelled(samples: Sequence[Sample], **labels: str) -> list[Sample]:
    return [s for s in samples if all(s.label(k) == v for k, v in labels.items())]


def render_interference(samples: Sequence[Sample]) -> list[str]:
    """Decode TPOT with / without prefill in the step, SLO attainment, the automatic mode."""
    name = m.ROUTER_DECODE_TPOT.name
    lines: list[str] = []
    if not any(s.name == f"{name}_count" for s in samples):
        return lines  # a router without the live monitor
    for label, text in (("with", "with prefill"), ("without", "without prefill")):
        mine = _labelled(samples, prefill=label)
        count = total(mine, f"{name}_count")
        mean = total(mine, f"{name}_sum") / count if count else None
        p50 = histogram_quantile(mine, name, 0.5)
        p95 = histogram_quantile(mine, name, 0.95)
        shown = "-" if mean is None else f"{mean * 1e3:.1f}ms"
        lines.append(
            f"decode tpot {text:<16} mean {shown:>9}  p50 {_ms(p50):>10}"
            f"  p95 {_ms(p95):>10}  n {count:g}"
        )
    targets = {s.label("slo"): s.value for s in samples if s.name == m.ROUTER_SLO_TARGET.name}
    attained = {s.label("slo"): s.value for s in samples if s.name == m.ROUTER_SLO_ATTAINMENT.name}
    if targets:
        window = "  ".join(
            f"{k} {attained[k]:.2f}" if k in attained else f"{k} -"
            for k in ("ttft", "tpot", "both")
        )
        outcomes = ", ".join(
            f"{s.label('outcome')}={s.value:g}"
            for s in samples
            if s.name == m.ROUTER_SLO_REQUESTS.name and s.value
        )
        lines.append(
            f"slo ttft {_ms(targets.get('ttft')).lstrip('≤')} tpot"
            f" {_ms(targets.get('tpot')).lstrip('≤')}  window attainment {window}"
            f"  since start {outcomes or '0'}"
        )
    roles = {s.label("role"): s.value for s in samples if s.name == m.ROUTER_AUTO_WORKERS.name}
    if roles:
        split = total(samples, m.ROUTER_AUTO_SPLIT.name) > 0
        layout = (
            f"split {roles.get('prefill', 0):g} prefill : {roles.get('decode', 0):g} decode"
            if split
            else f"colocated ({roles.get('both', 0):g} workers)"
        )
        changes = ", ".join(
            f"{s.label('action')}/{s.label('reason')}={s.value:g}"
            for s in samples
            if s.name == m.ROUTER_AUTO_DECISIONS.name and s.label("action") != "keep" and s.value
        )
        lines.append(f"layout {layout}  changes {changes or 'none'}")
    return lines


def render_frame(
    status: ClusterStatus,
    samples: Sequence[Sample],
    previous: Sequence[Sample] | None,
    interval_s: float,
    now: str,
) -> str:
    """One whole frame (no escape codes)."""
    return "\n".join(
        [
            f"pdserve top  {now}  every {interval_s:g} s",
            render_table(status),
            "",
            *render_metrics(samples, previous, interval_s),
            *render_interference(samples),
        ]
    )


def fetch_metrics(router_url: str, timeout_s: float = 3.0) -> list[Sample]:
    """The router's /metrics, parsed."""
    # A router whose /metrics has a key: the same key from the environment (never argv).
    key = load_key(KeyKind.METRICS)
    headers = {"Authorization": f"Bearer {key.text}"} if key is not None else {}
    try:
        request = Request(f"{router_url}/metrics", headers=headers)
        with urlopen(request, timeout=timeout_s) as resp:
            return parse(resp.read().decode())
    except (URLError, OSError, ValueError) as exc:
        raise StatusError(f"router {router_url} did not answer /metrics: {exc}") from None


def run_top(
    router_url: str,
    interval_s: float,
    once: bool,
    out: TextIO | None = None,
    sleep: Callable[[float], None] = time.sleep,
    max_frames: int | None = None,
) -> int:
    """Draw frames until interrupted (or one frame with `once`); returns the exit status."""
    # sys.stdout read at call time, not bound at import: a replaced stdout (tests, pipes) wins.
    out = out if out is not None else sys.stdout
    previous: list[Sample] | None = None
    frames = 0
    try:
        while True:
            status = collect_status(router_url)
            samples = fetch_metrics(router_url)
            frame = render_frame(status, samples, previous, interval_s, time.strftime("%H:%M:%S"))
            out.write(frame + "\n" if once else CLEAR + frame + "\n")
            out.flush()
            frames += 1
            if once or (max_frames is not None and frames >= max_frames):
                return 0
            previous = samples
            sleep(interval_s)
    except KeyboardInterrupt:
        return 0


def build_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    tp = argparse.ArgumentParser(prog="pdserve top", description=__doc__.splitlines()[0])
    tp.add_argument("--url", default=None, help="router URL (default: the running `pdserve up`)")
    tp.add_argument(
        "--interval", type=positive_float, default=2.0, help="seconds between refreshes"
    )
    tp.add_argument("--once", action="store_true", help="print one frame, no escape codes")
    add_tls_flags(tp)
    return tp


def _top(args: argparse.Namespace) -> int:
    dial_with_tls(args)
    return run_top(find_router_url(args.url), args.interval, args.once)


def main(argv: Sequence[str]) -> int:
    """Run the command; returns the exit status."""
    return run(
        "top",
        build_parser(),
        _top,
        argv,
    )
