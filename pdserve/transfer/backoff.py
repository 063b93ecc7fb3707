"""Retry delays: exponential backoff with full jitter, bounded by a deadline.

Full jitter (a uniform draw in [0, min(cap, base * 2**attempt)]) spreads retries of many
transfers that failed together, so they do not hit the peer in lock-step. The schedule never
plans a retry past the deadline (the lease deadline of the held KV): once the next delay would
cross it, `next_delay` returns None and the caller falls back (re-prefill or recompute).
Randomness is an injected `random.Random`, so tests replay exact schedules.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pdserve.errors import ConfigError


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    """How many times and how far apart to retry."""

    # Delay ceiling of the first retry, in seconds.
    base_s: float = 0.05
    # No single delay is longer than this.
    cap_s: float = 2.0
    # Retries after the first attempt.
    max_retries: int = 4

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.cap_s < self.base_s:
            raise ConfigError(f"backoff: need 0 < base_s <= cap_s, got {self.base_s}, {self.cap_s}")
        if self.max_retries < 0:
            raise ConfigError(f"backoff: max_retries must be >= 0, got {self.max_retries}")


class Backoff:
    """The retry schedule of one operation."""

    def __init__(self, policy: BackoffPolicy, rng: random.Random, deadline: float) -> None:
        self.policy = policy
        self.rng = rng
        self.deadline = deadline
        self.retries = 0

    def next_delay(self, now: float) -> float | None:
        """Seconds to wait before the next retry, or None when retries are exhausted."""
        if self.retries >= self.policy.max_retries:
            return None
        ceiling = min(self.policy.cap_s, self.policy.base_s * (2**self.retries))
        delay = self.rng.uniform(0.0, ceiling)
        if now + delay >= self.deadline:
            return None
        self.retries += 1
        return delay
