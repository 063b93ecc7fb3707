"""The arithmetic of the handoff-overhead benchmark: what the split adds to single requests.

The same prompts go one at a time to a disaggregated and a colocated cluster. For each prompt
(a pair of requests) the overhead of the split is the disaggregated time minus the colocated
one; the figure is the median over the pairs, which cancels what both requests of a pair share
(prompt length, background load at that moment). Two times are compared:

- TTFT (time to the first token). The router streams the prefill worker's first token as soon
  as the prefill returns, before the KV moves, so the split's TTFT overhead is the reservation,
  the value digest and the extra hop, not the transfer;
- time to the second token, which is where the transfer lands: the decode worker can send it
  only after the KV arrived and was verified.

Each is set against the measured transfer time of the same requests' KV (the prefill worker's
acknowledged-send time, first connect to final Ack). Target: TTFT overhead <= transfer time +
`SLACK_S`.

On a busy machine the prefill's own compute time varies by tens of ms from one run of a prompt
to the next, which swamps a few ms of overhead. So the TTFT overhead is also given without it:
each request's TTFT minus its worker's own time from admitting it to its first token (the
prefill worker's prefill, the colocated worker's generate), i.e. what the serving path adds
around the compute.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

# What the split may add to TTFT beyond the transfer itself.
SLACK_S = 0.005


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """One request as the client saw it, and (disaggregated) how its KV travelled."""

    ttft_s: float
    second_token_s: float
    # The prefill worker's send time of this request's KV (None when colocated).
    transfer_s: float | None = None
    num_bytes: int = 0
    transport: str | None = None
    # The worker's own time from admitting the request to its first token (None: unknown).
    worker_ttft_s: float | None = None


@dataclass(frozen=True, slots=True)
class OverheadSummary:
    """Medians over the pairs, and the verdict."""

    num_pairs: int
    ttft_disagg_s: float
    ttft_colocated_s: float
    ttft_overhead_s: float
    second_token_overhead_s: float
    transfer_s: float
    transfer_bytes: int
    transports: tuple[str, ...]
    # Spread of the paired TTFT differences (quartiles), to read the overhead against.
    ttft_overhead_q1_s: float
    ttft_overhead_q3_s: float
    # The TTFT overhead without either worker's compute time (None if a worker time is missing).
    ttft_overhead_excl_compute_s: float | None = None

    @property
    def bound_s(self) -> float:
        return self.transfer_s + SLACK_S

    @property
    def met(self) -> bool:
        return self.ttft_overhead_s <= self.bound_s


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def summarize(disagg: list[RequestTiming], colocated: list[RequestTiming]) -> OverheadSummary:
    """The overhead of the split over prompt-paired requests; ValueError on a bad pairing."""
    if not disagg or len(disagg) != len(colocated):
        raise ValueError(
            f"need as many disaggregated as colocated requests (>= 1), got {len(disagg)} and "
            f"{len(colocated)}"
        )
    transfers = [d.transfer_s for d in disagg]
    if any(t is None for t in transfers):
        raise ValueError("every disaggregated request needs its measured transfer time")
    ttft_diffs = [d.ttft_s - c.ttft_s for d, c in zip(disagg, colocated, strict=True)]
    second_diffs = [
        d.second_token_s - c.second_token_s for d, c in zip(disagg, colocated, strict=True)
    ]
    q1, q3 = _quartiles(ttft_diffs)
    path_diffs = [
        (d.ttft_s - d.worker_ttft_s) - (c.ttft_s - c.worker_ttft_s)
        for d, c in zip(disagg, colocated, strict=True)
        if d.worker_ttft_s is not None and c.worker_ttft_s is not None
    ]
    return OverheadSummary(
        num_pairs=len(disagg),
        ttft_disagg_s=statistics.median(d.ttft_s for d in disagg),
        ttft_colocated_s=statistics.median(c.ttft_s for c in colocated),
        ttft_overhead_s=statistics.median(ttft_diffs),
        second_token_overhead_s=statistics.median(second_diffs),
        transfer_s=statistics.median(t for t in transfers if t is not None),
        transfer_bytes=int(statistics.median(d.num_bytes for d in disagg)),
        transports=tuple(sorted({d.transport for d in disagg if d.transport})),
        ttft_overhead_q1_s=q1,
        ttft_overhead_q3_s=q3,
        ttft_overhead_excl_compute_s=(
            statistics.median(path_diffs) if len(path_diffs) == len(disagg) else None
        ),
    )


def summary_json(summary: OverheadSummary) -> dict[str, object]:
    """The JSON section of the handoff overhead."""
    return {
        "num_pairs": summary.num_pairs,
        "ttft_disagg_s": summary.ttft_disagg_s,
        "ttft_colocated_s": summary.ttft_colocated_s,
        "ttft_overhead_s": summary.ttft_overhead_s,
        "ttft_overhead_quartiles_s": [summary.ttft_overhead_q1_s, summary.ttft_overhead_q3_s],
        "ttft_overhead_excl_compute_s": summary.ttft_overhead_excl_compute_s,
        "second_token_overhead_s": summary.second_token_overhead_s,
        "transfer_s": summary.transfer_s,
        "transfer_bytes": summary.transfer_bytes,
        "transports": list(summary.transports),
        "bound_s": summary.bound_s,
        "met": summary.met,
    }


def render(summary: OverheadSummary) -> str:
    """The section of the printed report."""
    ms = 1e3
    verdict = "met" if summary.met else "MISSED"
    return "\n".join(
        [
            f"handoff overhead, {summary.num_pairs} single requests per mode (median of the"
            " paired differences):",
            f"  TTFT disagg {summary.ttft_disagg_s * ms:.1f} ms, colocated "
            f"{summary.ttft_colocated_s * ms:.1f} ms: overhead {summary.ttft_overhead_s * ms:.1f}"
            f" ms (quartiles {summary.ttft_overhead_q1_s * ms:.1f} .. "
            f"{summary.ttft_overhead_q3_s * ms:.1f})",
            "  TTFT overhead without the workers' own compute time: "
            + (
                "unknown"
                if summary.ttft_overhead_excl_compute_s is None
                else f"{summary.ttft_overhead_excl_compute_s * ms:.1f} ms"
            ),
            f"  second token overhead {summary.second_token_overhead_s * ms:.1f} ms",
            f"  KV transfer {summary.transfer_bytes / 2**20:.1f} MiB over "
            f"{'/'.join(summary.transports) or '?'} in {summary.transfer_s * ms:.1f} ms",
            f"  target: TTFT overhead <= transfer + {SLACK_S * ms:.0f} ms = "
            f"{summary.bound_s * ms:.1f} ms: {verdict}",
        ]
    )
