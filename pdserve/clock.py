"""Injected time: every lease, deadline and backoff reads a `Clock`, never `time` directly.

`MonotonicClock` is the real one. `FakeClock` only moves when a test calls `advance`, so lease
expiry and retry backoff are tested instantly and deterministically; its `sleep` advances the
fake time instead of blocking.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic time in seconds and nanoseconds, and a sleep that honours it."""

    def now(self) -> float: ...

    def now_ns(self) -> int: ...

    def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """The process's monotonic clock."""

    def now(self) -> float:
        return time.monotonic()

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))


class FakeClock:
    """A clock that moves only when told to; `sleep` advances it."""

    def __init__(self, start: float = 1000.0) -> None:
        self._ns = int(start * 1e9)

    def now(self) -> float:
        return self._ns / 1e9

    def now_ns(self) -> int:
        return self._ns

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"FakeClock.advance: negative step {seconds}")
        self._ns += round(seconds * 1e9)

    def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))
