"""Health deadlines: which workers are drained, when, and how often. Pure."""

from __future__ import annotations

from test_affinity_policy import view

from pdserve.router.workers.health_watch import HealthDeadline


def test_a_worker_silent_past_the_deadline_is_drained_once_per_episode() -> None:
    d = HealthDeadline(deadline_s=3.0)
    up, down = view(0), view(0, healthy=False)
    other = view(1)
    assert d.due([up, other], 0.0) == []
    assert d.due([down, other], 1.0) == []  # unhealthy since 1.0
    assert d.due([down, other], 3.9) == []
    assert d.due([down, other], 4.0) == ["http://w0"]
    assert d.due([down, other], 9.0) == []  # drained already
    assert d.due([up, other], 10.0) == []  # answers again: the episode ends
    assert d.due([down, other], 11.0) == []
    assert d.due([down, other], 14.5) == ["http://w0"]


def test_a_worker_that_left_the_pool_is_forgotten() -> None:
    d = HealthDeadline(deadline_s=1.0)
    assert d.due([view(0, healthy=False)], 0.0) == []
    assert d.due([], 0.5) == []
    assert d.due([view(0, healthy=False)], 1.2) == []  # a new episode began at 1.2
    assert d.due([view(0, healthy=False)], 2.2) == ["http://w0"]
