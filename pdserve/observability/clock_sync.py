"""Offset between another process's monotonic clock and ours, from request/response echoes.

NTP-style, with the four timestamps of one echo: we send at `sent_ns` (our clock), the peer
receives at `remote_received_ns` and replies at `remote_sent_ns` (its clock), we receive at
`received_ns`. Causality alone bounds the offset (peer minus ours): the request cannot arrive
before it left and the reply cannot arrive before it was sent, so

    remote_sent_ns - received_ns  <=  offset  <=  remote_received_ns - sent_ns

whatever the asymmetry of the two directions or the time the peer spent in between. Each echo
is such an interval; the offset is the midpoint of the intersection of the last `window`
intervals, and half its width the error bound. More echoes only narrow it, down to the
fastest one-way delays seen. Placing a peer's events with any offset inside the intersection
keeps them in causal order with our own events around any call at least as slow as the
fastest echo. The intersection can only come out empty if the clocks drift apart within the
window; the estimate then falls back to the echo with the shortest round trip (classic NTP).

Pure: the caller reads the clocks and does the I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ClockSample:
    """One echo: the offset interval it proves, in nanoseconds (peer clock minus ours)."""

    low_ns: int
    high_ns: int

    @property
    def rtt_ns(self) -> int:
        """Round trip minus the peer's own processing time."""
        return self.high_ns - self.low_ns

    @property
    def offset_ns(self) -> int:
        """The interval's midpoint (the classic NTP estimate)."""
        return (self.low_ns + self.high_ns) // 2


@dataclass(slots=True)
class ClockSync:
    """Offset estimate (peer minus local) over the last `window` echoes."""

    window: int = 16
    _samples: deque[ClockSample] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        self._samples = deque(maxlen=self.window)

    def add(
        self,
        sent_ns: int,
        remote_received_ns: int,
        received_ns: int,
        remote_sent_ns: int | None = None,
    ) -> ClockSample:
        """Record one echo (`remote_sent_ns` None: the peer stamped once); ValueError if the
        stamps contradict themselves (answer before question, reply before request)."""
        remote_sent = remote_received_ns if remote_sent_ns is None else remote_sent_ns
        if received_ns < sent_ns or remote_sent < remote_received_ns:
            raise ValueError(
                f"inconsistent echo: sent {sent_ns}, received {received_ns},"
                f" peer received {remote_received_ns}, peer sent {remote_sent}"
            )
        sample = ClockSample(remote_sent - received_ns, remote_received_ns - sent_ns)
        self._samples.append(sample)
        return sample

    @property
    def interval(self) -> ClockSample | None:
        """The intersection of the window's intervals; None if no sample or it is empty."""
        if not self._samples:
            return None
        low = max(s.low_ns for s in self._samples)
        high = min(s.high_ns for s in self._samples)
        return ClockSample(low, high) if low <= high else None

    @property
    def best(self) -> ClockSample | None:
        """The echo with the shortest round trip (the earliest one among equals)."""
        return min(self._samples, key=lambda s: s.rtt_ns, default=None)

    @property
    def offset_ns(self) -> int | None:
        """Peer clock minus local clock; None before any sample."""
        chosen = self.interval or self.best
        return None if chosen is None else chosen.offset_ns

    @property
    def error_ns(self) -> int | None:
        """Bound on the offset's error: half the width of the interval it came from."""
        chosen = self.interval or self.best
        return None if chosen is None else (chosen.rtt_ns + 1) // 2

    def estimate(self, low_ns: int | None = None, high_ns: int | None = None) -> ClockSample | None:
        """The window's intersection narrowed by extra bounds (e.g. a request's own calls,
        `timeline_merge.call_bounds`); where they contradict the window, the extra bounds win
        (they are the freshest), and missing ones fall back to `interval` or `best`."""
        base = self.interval or self.best
        low = (
            low_ns
            if base is None
            else max(base.low_ns, low_ns if low_ns is not None else base.low_ns)
        )
        high = (
            high_ns
            if base is None
            else min(base.high_ns, high_ns if high_ns is not None else base.high_ns)
        )
        if low is not None and high is not None and low <= high:
            return ClockSample(low, high)
        if low_ns is not None and high_ns is not None and low_ns <= high_ns:
            return ClockSample(low_ns, high_ns)
        return base

    def to_local(self, remote_ns: int) -> int | None:
        """A peer timestamp on our clock; None before any sample."""
        offset = self.offset_ns
        return None if offset is None else remote_ns - offset
