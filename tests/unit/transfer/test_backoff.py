"""Backoff: full jitter under an exponential ceiling, bounded by retries and the deadline."""

from __future__ import annotations

import random

import pytest

from pdserve.errors import ConfigError
from pdserve.transfer.backoff import Backoff, BackoffPolicy


def test_delays_stay_under_the_exponential_ceiling_and_stop_after_max_retries() -> None:
    policy = BackoffPolicy(base_s=0.1, cap_s=0.5, max_retries=5)
    b = Backoff(policy, random.Random(3), deadline=1e9)
    delays = [b.next_delay(0.0) for _ in range(6)]
    assert delays[5] is None
    ceilings = [0.1, 0.2, 0.4, 0.5, 0.5]
    for d, c in zip(delays[:5], ceilings, strict=True):
        assert d is not None and 0.0 <= d <= c


def test_same_seed_same_schedule_and_jitter_varies() -> None:
    policy = BackoffPolicy(base_s=1.0, cap_s=1.0, max_retries=50)
    a = Backoff(policy, random.Random(7), deadline=1e9)
    b = Backoff(policy, random.Random(7), deadline=1e9)
    da = [a.next_delay(0.0) for _ in range(50)]
    assert da == [b.next_delay(0.0) for _ in range(50)]
    assert len({round(d or 0, 6) for d in da}) > 40


def test_no_retry_is_planned_past_the_deadline() -> None:
    b = Backoff(
        BackoffPolicy(base_s=10.0, cap_s=10.0, max_retries=100), random.Random(1), deadline=5.0
    )
    now = 0.0
    while (d := b.next_delay(now)) is not None:
        now += d
        assert now < 5.0
    assert b.retries < 100


def test_bad_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="base_s"):
        BackoffPolicy(base_s=0.0)
    with pytest.raises(ConfigError, match="max_retries"):
        BackoffPolicy(max_retries=-1)
