"""The circuit breaker's exact state sequences on a fake clock, and its invariants."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdserve.clock import FakeClock
from pdserve.router.config import BreakerConfig
from pdserve.router.mode.breaker import BreakerState, CircuitBreaker

CFG = BreakerConfig(window=10, min_samples=4, failure_rate=0.5, cooldown_s=5.0)


def test_opens_at_the_threshold_probes_after_cooldown_and_closes_on_success() -> None:
    clock = FakeClock()
    b = CircuitBreaker(CFG, clock)
    for ok in (True, False, True):
        b.record(ok)
    assert b.state is BreakerState.CLOSED  # 3 outcomes < min_samples
    b.record(False, "KVNotReady")
    assert b.state is BreakerState.OPEN and "2/4 handoffs failed" in b.transitions[-1].reason
    assert not b.admit()
    clock.advance(5.0)
    assert b.admit()  # the probe
    assert b.state is BreakerState.HALF_OPEN
    assert not b.admit()  # one probe at a time
    b.record(True)
    assert b.state is BreakerState.CLOSED and b.failure_rate == 0.0
    assert [(t.source, t.target) for t in b.transitions] == [
        (BreakerState.CLOSED, BreakerState.OPEN),
        (BreakerState.OPEN, BreakerState.HALF_OPEN),
        (BreakerState.HALF_OPEN, BreakerState.CLOSED),
    ]
    assert b.counts[("closed", "open")] == 1 and b.counts[("half_open", "closed")] == 1


def test_a_failed_probe_reopens_and_restarts_the_cooldown() -> None:
    clock = FakeClock()
    b = CircuitBreaker(CFG, clock)
    for _ in range(4):
        b.record(False)
    clock.advance(5.0)
    assert b.admit()
    b.record(False, "still broken")
    assert b.state is BreakerState.OPEN
    clock.advance(4.9)
    assert not b.admit()
    clock.advance(0.1)
    assert b.admit()


def test_a_probe_that_never_reports_is_replaced_after_a_cooldown() -> None:
    clock = FakeClock()
    b = CircuitBreaker(CFG, clock)
    for _ in range(4):
        b.record(False)
    clock.advance(5.0)
    assert b.admit() and not b.admit()
    clock.advance(5.0)
    assert b.admit()  # the first probe was lost (cancelled, finished on its first token)


def test_disabled_breaker_always_admits() -> None:
    b = CircuitBreaker(BreakerConfig(enabled=False), FakeClock())
    for _ in range(50):
        b.record(False)
    assert b.admit() and b.state is BreakerState.CLOSED


@given(st.lists(st.tuples(st.booleans(), st.floats(0, 3)), max_size=200))
def test_invariants_under_any_outcome_sequence(events: list[tuple[bool, float]]) -> None:
    clock = FakeClock()
    b = CircuitBreaker(CFG, clock)
    for outcomes, (ok, dt) in enumerate(events, start=1):
        clock.advance(dt)
        b.admit()
        was = b.state
        b.record(ok)
        if was is BreakerState.CLOSED and b.state is BreakerState.OPEN:
            assert outcomes >= CFG.min_samples
        if b.state is BreakerState.CLOSED:
            assert b.failure_rate < CFG.failure_rate or len(b._window) < CFG.min_samples


def test_every_transition_is_told_however_many() -> None:
    # The history is bounded; the log of transitions must not be (it stopped at 100 before).
    clock = FakeClock()
    seen: list[str] = []
    config = BreakerConfig(window=2, min_samples=1, failure_rate=0.5, cooldown_s=1.0)
    breaker = CircuitBreaker(
        config, clock, max_history=5, on_transition=lambda t: seen.append(t.target.value)
    )
    for _ in range(150):
        breaker.record(False, "x")  # closed -> open
        clock.advance(1.5)
        assert breaker.admit()  # open -> half_open
        breaker.record(True)  # half_open -> closed
    assert len(seen) == 450 and len(breaker.transitions) == 5
