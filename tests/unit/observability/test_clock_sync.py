"""Offset estimation from echoes, on synthetic clocks: intervals, intersection, fallback."""

from __future__ import annotations

import pytest

from pdserve.observability.clock_sync import ClockSync

US = 1_000


def test_a_symmetric_echo_gives_the_exact_offset() -> None:
    sync = ClockSync()
    # Peer runs 5 s ahead; 1 ms each way; it answers at once.
    sample = sync.add(sent_ns=1_000_000, remote_received_ns=5_002_000_000, received_ns=3_000_000)
    assert (sample.low_ns, sample.high_ns) == (4_999_000_000, 5_001_000_000)
    assert sync.offset_ns == 5_000_000_000 and sync.error_ns == 1_000_000
    assert sync.to_local(5_010_000_000) == 10_000_000


def test_the_peer_s_processing_time_does_not_widen_the_interval() -> None:
    sync = ClockSync()
    # 100 us out, 5 ms in the peer's handler, 100 us back; peer clock = ours - 7 s.
    off = -7_000_000_000
    sync.add(0, 100 * US + off, 5_200 * US, remote_sent_ns=5_100 * US + off)
    assert sync.offset_ns == off and sync.error_ns == 100 * US


def test_intersecting_asymmetric_echoes_narrows_to_the_truth() -> None:
    off = 3_000 * US
    sync = ClockSync()
    # A slow way out (900 us) and a fast way back (100 us): the midpoint alone is 400 us off.
    sync.add(0, 900 * US + off, 1_000 * US)
    assert sync.offset_ns == off + 400 * US and sync.error_ns == 500 * US
    # Then a fast way out (100 us) and a slow way back (900 us).
    sync.add(10_000 * US, 10_100 * US + off, 11_000 * US)
    assert (sync.interval.low_ns, sync.interval.high_ns) == (off - 100 * US, off + 100 * US)  # type: ignore[union-attr]
    assert sync.offset_ns == off and sync.error_ns == 100 * US
    assert abs(sync.offset_ns - off) <= sync.error_ns


def test_an_empty_intersection_falls_back_to_the_shortest_round_trip() -> None:
    sync = ClockSync(window=4)
    sync.add(0, 50, 100)  # offset in [-50, 50]
    sync.add(1_000, 1_400, 1_040)  # in [360, 400]: the clocks moved (drift)
    assert sync.interval is None
    assert sync.offset_ns == 380 and sync.error_ns == 20


def test_old_samples_leave_the_window() -> None:
    sync = ClockSync(window=2)
    sync.add(0, 5, 10)  # [-5, 5]
    sync.add(100, 150, 300)  # [-150, 50]
    sync.add(400, 500, 700)  # [-200, 100]: the first one is gone
    assert (sync.interval.low_ns, sync.interval.high_ns) == (-150, 50)  # type: ignore[union-attr]


def test_no_sample_no_offset_and_stamps_must_be_consistent() -> None:
    sync = ClockSync()
    assert sync.offset_ns is None and sync.error_ns is None and sync.to_local(5) is None
    with pytest.raises(ValueError, match="inconsistent echo"):
        sync.add(10, 0, 5)
    with pytest.raises(ValueError, match="inconsistent echo"):
        sync.add(0, 10, 20, remote_sent_ns=5)
    with pytest.raises(ValueError, match="window"):
        ClockSync(window=0)


def test_extra_bounds_narrow_the_estimate_and_win_a_contradiction() -> None:
    sync = ClockSync()
    sync.add(0, 1_000, 2_000)  # [-1000, 1000]
    chosen = sync.estimate(low_ns=-100, high_ns=300)
    assert chosen is not None and (chosen.low_ns, chosen.high_ns) == (-100, 300)
    one_sided = sync.estimate(high_ns=0)
    assert one_sided is not None and (one_sided.low_ns, one_sided.high_ns) == (-1_000, 0)
    # Bounds outside the window (the clock moved): the request's own bounds are used.
    moved = sync.estimate(low_ns=5_000, high_ns=5_200)
    assert moved is not None and moved.offset_ns == 5_100
    assert ClockSync().estimate() is None
    assert ClockSync().estimate(low_ns=1, high_ns=3) is not None
