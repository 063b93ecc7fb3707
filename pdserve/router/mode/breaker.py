"""The KV-path circuit breaker: too many failed handoffs and new requests run colocated. Pure.

    CLOSED ──failure rate over the window >= threshold (>= min_samples outcomes)──► OPEN
    OPEN ──cooldown_s passed──► HALF_OPEN: one probe request is let through disaggregated
    HALF_OPEN ──probe's handoff succeeded──► CLOSED (window cleared)
              ──probe's handoff failed──► OPEN (cooldown restarts)
              ──no outcome within cooldown_s (probe cancelled, finished on its first token)──►
                another probe may go

`admit()` answers, per new request, whether it may take the disaggregated path; `record()`
takes every handoff outcome. Every transition is counted and handed to `on_transition` (the
router logs each one there), and the last `max_history` are kept for health. Time comes only
from the injected clock.
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.clock import Clock
from pdserve.router.config import BreakerConfig


class BreakerState(enum.Enum):
    """Where the breaker is."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerTransition:
    """One state change, with why and when (clock seconds)."""

    source: BreakerState
    target: BreakerState
    reason: str
    at_s: float


class CircuitBreaker:
    """Counts handoff outcomes over a window and opens, probes and closes on them."""

    def __init__(
        self,
        config: BreakerConfig,
        clock: Clock,
        max_history: int = 100,
        on_transition: Callable[[BreakerTransition], None] | None = None,
    ) -> None:
        self._config = config
        # Told of every transition, however many (the history below is bounded).
        self.on_transition = on_transition
        self._clock = clock
        self._window: deque[bool] = deque(maxlen=config.window)
        self.state = BreakerState.CLOSED
        self._opened_at = 0.0
        self._probe_at: float | None = None
        self.transitions: deque[BreakerTransition] = deque(maxlen=max_history)
        self.counts: Counter[tuple[str, str]] = Counter()

    @property
    def failure_rate(self) -> float:
        """Failures / outcomes in the window (0 when empty)."""
        return self._window.count(False) / len(self._window) if self._window else 0.0

    def admit(self) -> bool:
        """Whether a new request may run disaggregated (False: run it colocated)."""
        if not self._config.enabled or self.state is BreakerState.CLOSED:
            return True
        now = self._clock.now()
        if self.state is BreakerState.OPEN:
            if now - self._opened_at < self._config.cooldown_s:
                return False
            self._move(BreakerState.HALF_OPEN, f"cooldown {self._config.cooldown_s} s over")
        # HALF_OPEN: one probe at a time; a probe that never reported is given up on.
        if self._probe_at is not None and now - self._probe_at < self._config.cooldown_s:
            return False
        self._probe_at = now
        return True

    def cooldown_over(self) -> bool:
        """True when the breaker is open and its cooldown has passed: the next `admit()` lets
        a half-open probe through (a read; nothing changes)."""
        return (
            self.state is BreakerState.OPEN
            and self._clock.now() - self._opened_at >= self._config.cooldown_s
        )

    def record(self, ok: bool, reason: str = "") -> None:
        """One handoff's outcome."""
        if not self._config.enabled:
            return
        if self.state is BreakerState.HALF_OPEN:
            self._probe_at = None
            if ok:
                self._window.clear()
                self._move(BreakerState.CLOSED, "probe handoff succeeded")
            else:
                self._open(f"probe handoff failed: {reason}")
            return
        if self.state is BreakerState.OPEN:
            return  # a request admitted before the breaker opened: already counted as the cause
        self._window.append(ok)
        cfg = self._config
        if len(self._window) >= cfg.min_samples and self.failure_rate >= cfg.failure_rate:
            self._open(
                f"{self._window.count(False)}/{len(self._window)} handoffs failed"
                f" (threshold {cfg.failure_rate:.0%}); last: {reason}"
            )

    def _open(self, reason: str) -> None:
        self._opened_at = self._clock.now()
        self._move(BreakerState.OPEN, reason)

    def _move(self, target: BreakerState, reason: str) -> None:
        transition = BreakerTransition(self.state, target, reason, self._clock.now())
        self.transitions.append(transition)
        self.counts[(self.state.value, target.value)] += 1
        self.state = target
        if self.on_transition is not None:
            self.on_transition(transition)
