"""What the KV transports really do, per worker: bytes and handoffs per transport, downgrades
with their reason, the rate each peer achieves, and transfers far below their transport's rate.

A downgrade that nobody sees is how upstream lost a 100x on TTFT (UCX quietly falling back to
TCP); so every send records the transport it used, every fallback is counted with why, and a
completed transfer of at least `MIN_BYTES_FOR_RATE` that ran below `SLOW_FRACTION` of its
transport's expected rate is counted as slow, named in health and reported to the router
(whose circuit breaker treats it as a failed handoff). Pure bookkeeping: no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric

from pdserve.observability import metric_names as m
from pdserve.observability.exposition import render_family
from pdserve.protocol.kv_rates import EXPECTED_GBPS, MIN_BYTES_FOR_RATE, SLOW_FRACTION, is_slow

# Weight of the newest transfer in a pair's moving average.
_EWMA_ALPHA = 0.3


@dataclass(slots=True)
class PairRate:
    """A peer's achieved rate over one transport."""

    gbps: float
    num_transfers: int
    slow: bool


@dataclass(slots=True)
class TransportStats:
    """Counters of one worker's KV traffic, rendered into /metrics and health."""

    bytes: Counter[tuple[str, str]] = field(default_factory=Counter)  # (transport, direction)
    handoffs: Counter[tuple[str, str]] = field(default_factory=Counter)
    downgrades: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    slow: Counter[str] = field(default_factory=Counter)
    pairs: dict[tuple[str, str], PairRate] = field(default_factory=dict)

    def sent(self, transport: str, peer: str, num_bytes: int, seconds: float) -> bool:
        """One acknowledged send; returns whether it was slow."""
        return self._done(transport, "sent", peer, num_bytes, seconds)

    def received(self, transport: str, peer: str, num_bytes: int, seconds: float) -> bool:
        """One verified receive; returns whether it was slow."""
        return self._done(transport, "received", peer, num_bytes, seconds)

    def downgraded(self, wanted: str, used: str, reason: str) -> None:
        """A send used `used` although the peer offered the better `wanted`."""
        self.downgrades[(wanted, used, reason)] += 1

    def probed(self, transport: str, peer: str, num_bytes: int, seconds: float) -> None:
        """One pair probe's transfer (`worker/kv/probe.py`), either side: the peer's rate
        only; the byte and handoff counters are the handoffs'."""
        self._rate(transport, peer, num_bytes, seconds)

    def _done(
        self, transport: str, direction: str, peer: str, num_bytes: int, seconds: float
    ) -> bool:
        self.bytes[(transport, direction)] += num_bytes
        self.handoffs[(transport, direction)] += 1
        slow = is_slow(transport, num_bytes, seconds)
        if slow:
            self.slow[transport] += 1
        self._rate(transport, peer, num_bytes, seconds)
        return slow

    def _rate(self, transport: str, peer: str, num_bytes: int, seconds: float) -> None:
        if num_bytes < MIN_BYTES_FOR_RATE or seconds <= 0:
            return
        gbps = num_bytes / seconds / 1e9
        pair = self.pairs.get((transport, peer))
        if pair is None:
            self.pairs[(transport, peer)] = PairRate(
                gbps, 1, is_slow(transport, num_bytes, seconds)
            )
            return
        pair.gbps += _EWMA_ALPHA * (gbps - pair.gbps)
        pair.num_transfers += 1
        pair.slow = is_slow(transport, MIN_BYTES_FOR_RATE, MIN_BYTES_FOR_RATE / pair.gbps / 1e9)

    def problems(self) -> list[str]:
        """Health problems: peers whose moving-average rate is far below the transport's."""
        return [
            f"KV over {transport} to/from {peer}: {pair.gbps:.2f} GB/s, under"
            f" {SLOW_FRACTION:.0%} of the {EXPECTED_GBPS.get(transport, 0):.0f} GB/s expected"
            for (transport, peer), pair in sorted(self.pairs.items())
            if pair.slow
        ]

    def render(self, worker_id: str) -> list[Metric]:
        """Prometheus lines of every family here."""
        w = {"worker_id": worker_id}
        lines: list[Metric] = []
        lines += render_family(
            m.WORKER_KV_TRANSPORT_BYTES,
            (
                ({**w, "transport": t, "direction": d}, n)
                for (t, d), n in sorted(self.bytes.items())
            ),
        )
        lines += render_family(
            m.WORKER_KV_TRANSPORT_HANDOFFS,
            (
                ({**w, "transport": t, "direction": d}, n)
                for (t, d), n in sorted(self.handoffs.items())
            ),
        )
        lines += render_family(
            m.WORKER_KV_TRANSPORT_DOWNGRADES,
            (
                ({**w, "wanted": a, "used": b, "reason": r}, n)
                for (a, b, r), n in sorted(self.downgrades.items())
            ),
        )
        lines += render_family(
            m.WORKER_KV_SLOW_TRANSFERS,
            (({**w, "transport": t}, n) for t, n in sorted(self.slow.items())),
        )
        lines += render_family(
            m.WORKER_KV_PAIR_THROUGHPUT,
            (
                ({**w, "transport": t, "peer": p}, round(pair.gbps, 4))
                for (t, p), pair in sorted(self.pairs.items())
            ),
        )
        return lines
