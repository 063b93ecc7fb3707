"""The spike detector on synthetic series, and handoff phases from a timeline."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.observability.phases import handoff_phases
from pdserve.observability.spikes import SpikeDetector
from pdserve.protocol.request_state import RequestState as S
from pdserve.protocol.request_state import RequestTimeline, Transition


def _noisy(n: int, center: float, spread: float, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [center + rng.uniform(-spread, spread) for _ in range(n)]


def test_a_spike_is_flagged_with_its_phase_and_request() -> None:
    d = SpikeDetector(min_samples=20)
    for i, v in enumerate(_noisy(50, 0.010, 0.002)):
        assert d.observe(f"r{i}", {"transfer": v, "prefill": 0.1}) == []
    (spike,) = d.observe("slow-1", {"transfer": 0.080, "prefill": 0.1})
    assert (spike.request_id, spike.phase) == ("slow-1", "transfer")
    assert 0.009 < spike.median_s < 0.011 and spike.threshold_s < 0.080
    assert d.counts == {"transfer": 1}
    assert "slow-1" in spike.describe() and "transfer" in spike.describe()


def test_nothing_is_flagged_before_min_samples() -> None:
    d = SpikeDetector(min_samples=10)
    for i in range(9):
        d.observe(f"r{i}", {"handoff": 0.01})
    assert d.observe("big", {"handoff": 10.0}) == []  # only 9 samples of baseline
    assert d.observe("big2", {"handoff": 10.0}) != []


def test_a_flat_phase_needs_the_ratio_not_just_the_mad() -> None:
    d = SpikeDetector(min_samples=5, min_ratio=2.0)
    for i in range(10):
        d.observe(f"r{i}", {"reserve": 0.005})  # MAD == 0
    assert d.observe("a", {"reserve": 0.0099}) == []  # under 2x the median
    assert d.observe("b", {"reserve": 0.0101}) != []


def test_one_spike_does_not_hide_the_next() -> None:
    d = SpikeDetector(min_samples=20)
    for i, v in enumerate(_noisy(40, 0.02, 0.004, seed=3)):
        d.observe(f"r{i}", {"transfer": v})
    assert d.observe("s1", {"transfer": 0.5})
    assert d.observe("s2", {"transfer": 0.5})
    assert d.counts["transfer"] == 2


@given(st.lists(st.floats(0.001, 0.05), min_size=30, max_size=100))
def test_values_at_or_under_the_running_median_are_never_spikes(values: list[float]) -> None:
    d = SpikeDetector(min_samples=20)
    for i, v in enumerate(values):
        baseline = d.threshold("p")
        spikes = d.observe(str(i), {"p": v})
        if baseline is not None and v <= baseline[0]:
            assert spikes == []


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="min_samples"):
        SpikeDetector(window=10, min_samples=20)
    with pytest.raises(ValueError, match="k > 0"):
        SpikeDetector(k=0)


def _timeline(steps: list[tuple[S, int]]) -> RequestTimeline:
    history = [Transition(state, ns, 0.0) for state, ns in steps]
    return RequestTimeline("r", "disagg", history)


def test_phases_from_a_timeline_use_the_last_completed_attempt() -> None:
    ms = 1_000_000
    t = _timeline(
        [
            (S.RECEIVED, 0),
            (S.ROUTED, 1 * ms),
            (S.RESERVED, 3 * ms),
            (S.PREFILLING, 4 * ms),
            (S.PREFILLED, 14 * ms),
            (S.TRANSFERRING, 15 * ms),
            (S.RETRYING, 40 * ms),  # the first transfer failed
            (S.ROUTED, 41 * ms),
            (S.RESERVED, 42 * ms),
            (S.PREFILLING, 42 * ms),
            (S.PREFILLED, 50 * ms),
            (S.TRANSFERRING, 51 * ms),
            (S.COMMITTED, 53 * ms),
            (S.DECODING, 54 * ms),
        ]
    )
    phases = handoff_phases(t.history)
    assert phases == pytest.approx(
        {"reserve": 0.001, "prefill": 0.008, "transfer": 0.002, "handoff": 0.004}
    )


def test_a_phase_never_completed_is_absent() -> None:
    t = _timeline([(S.RECEIVED, 0), (S.ROUTED, 10), (S.DECODING, 20)])
    assert handoff_phases(t.history) == {}
