"""The lifeline without processes: a pipe stands for the launcher, closing its write end for the
launcher's death."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from pdserve.child.lifeline import ENV_VAR, Lifeline, watch_lifeline


def test_the_child_learns_its_launcher_died_when_the_write_end_closes() -> None:
    lifeline = Lifeline()
    lost = threading.Event()
    thread = watch_lifeline(lifeline.environment(), on_lost=lost.set)
    assert thread is not None and thread.daemon
    assert not lost.wait(0.05)  # alive launcher: nothing happens
    lifeline.close()
    assert lost.wait(10)
    thread.join(10)
    lifeline.close()  # idempotent
    os.close(lifeline.child_fd)


def test_no_lifeline_in_the_environment_watches_nothing() -> None:
    assert watch_lifeline({}, on_lost=lambda: None) is None


@pytest.mark.parametrize("value", ["seven", "987654"])
def test_a_lifeline_that_names_no_open_fd_is_reported_and_ignored(
    value: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert watch_lifeline({ENV_VAR: value}, on_lost=lambda: None) is None
    assert f"{ENV_VAR}={value!r} names no open file descriptor" in caplog.text


def test_the_launchers_ends_are_not_inherited_by_other_children() -> None:
    lifeline = Lifeline()
    # The child's end becomes inheritable only through pass_fds, for the one child.
    assert not os.get_inheritable(lifeline.child_fd)
    lifeline.started()
    with pytest.raises(OSError):
        os.fstat(lifeline.child_fd)
    lifeline.close()
