"""Restart policy and liveness: exact delays, when a crash loop is given up and why. Pure."""

from __future__ import annotations

import pytest

from pdserve.errors import ConfigError
from pdserve.supervise.policy import (
    Action,
    Decision,
    Liveness,
    RestartHistory,
    RestartPolicy,
    describe_exit,
)

POLICY = RestartPolicy(
    initial_backoff_s=0.5, max_backoff_s=4.0, factor=2.0, stable_s=10.0, max_restarts=5, window_s=60
)


def test_backoff_doubles_up_to_its_ceiling_while_the_process_keeps_dying() -> None:
    h = RestartHistory(POLICY)
    h.on_start(0.0)
    delays = []
    now = 0.0
    for _ in range(5):
        now += 1.0  # up for 1 s each time: never stable
        d = h.on_exit(now, 1)
        assert d.action is Action.RESTART
        delays.append(d.delay_s)
        now += d.delay_s
        h.on_restart(now)
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert h.num_restarts == 5


def test_a_process_that_stayed_up_starts_the_backoff_over() -> None:
    h = RestartHistory(POLICY)
    h.on_start(0.0)
    assert h.on_exit(1.0, 1).delay_s == 0.5
    h.on_restart(1.5)
    assert h.on_exit(2.0, 1).delay_s == 1.0
    h.on_restart(3.0)
    assert h.on_exit(3.0 + 10.0, -9).delay_s == 0.5  # up 10 s: a new failure


def test_more_exits_than_allowed_in_the_window_is_a_crash_loop() -> None:
    policy = RestartPolicy(initial_backoff_s=0.1, max_restarts=2, window_s=30.0)
    h = RestartHistory(policy)
    h.on_start(0.0)
    assert h.on_exit(1.0, 1).action is Action.RESTART
    h.on_restart(1.1)
    assert h.on_exit(2.0, 1).action is Action.RESTART
    h.on_restart(2.2)
    d = h.on_exit(3.0, 3)
    assert d == Decision(
        Action.GIVE_UP,
        reason="exited 3 times within 30 s (last: exit code 3): a crash loop, not restarted",
    )


def test_exits_older_than_the_window_do_not_count() -> None:
    policy = RestartPolicy(initial_backoff_s=0.1, max_restarts=1, window_s=10.0)
    h = RestartHistory(policy)
    h.on_start(0.0)
    assert h.on_exit(1.0, 1).action is Action.RESTART
    h.on_restart(1.1)
    assert h.on_exit(20.0, 1).action is Action.RESTART  # the first exit left the window
    h.on_restart(20.1)
    assert h.on_exit(21.0, 1).action is Action.GIVE_UP


def test_exit_statuses_are_described() -> None:
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(-9) == "killed by signal 9"
    assert describe_exit(None) == "unknown status"


def test_liveness_declares_a_silent_process_dead_once_per_episode() -> None:
    live = Liveness(timeout_s=3.0)
    assert not live.on_probe(0.0, True)
    assert not live.on_probe(1.0, False)
    assert not live.on_probe(3.9, False)
    assert live.on_probe(4.0, False)  # silent since 1.0
    assert not live.on_probe(9.0, False)  # already declared
    assert not live.on_probe(10.0, True)
    assert not live.on_probe(11.0, False)
    assert live.on_probe(14.0, False)  # a new episode


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"initial_backoff_s": 0.0}, "restart-backoff"),
        ({"initial_backoff_s": 5.0, "max_backoff_s": 1.0}, "restart-backoff"),
        ({"factor": 0.5}, "factor"),
        ({"max_restarts": -1}, "max-restarts"),
        ({"window_s": 0.0}, "window"),
    ],
)
def test_bad_policies_are_refused_naming_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        RestartPolicy(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="liveness"):
        Liveness(0.0)
