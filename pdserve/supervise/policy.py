"""When a supervised process is restarted, and when it is given up on. Pure: times are passed in.

Restart with backoff: the first restart after an exit waits `initial_backoff_s`, each further
one `factor` times longer, at most `max_backoff_s`; a process that stayed up `stable_s` before
exiting starts the sequence over (it was healthy; this is a new failure, not the same one).
Crash loop: when a process exits more than `max_restarts` times within `window_s`, restarting
it again would only repeat the failure; it is given up with a reason naming the count, the
window and the last exit status, and stays down until an operator acts.

Liveness: a process that answers no health probe for `timeout_s` (hung, or stopped by
SIGSTOP) is declared dead once per episode; the supervisor kills it and the restart rules
above apply. A successful probe ends the episode.

Every decision is a value (`Decision`); nothing here sleeps, signals or reads a clock.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from pdserve.errors import ConfigError
from pdserve.flag_types import non_negative_int, positive_float
from pdserve.settings import setting


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How a supervisor restarts a process that exited."""

    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    factor: float = 2.0
    # Up this long before an exit: the backoff sequence starts over.
    stable_s: float = 30.0
    # More than this many exits within `window_s` is a crash loop.
    max_restarts: int = setting(
        5,
        type=non_negative_int,
        help="exits of one process within --restart-window-s before it is given up",
    )
    window_s: float = setting(60.0, name="restart-window-s", type=positive_float)

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ConfigError(
                f"restart-backoff: need 0 < initial ({self.initial_backoff_s}) <= max"
                f" ({self.max_backoff_s})"
            )
        if self.factor < 1:
            raise ConfigError(f"restart backoff factor: must be >= 1, got {self.factor}")
        if self.max_restarts < 0:
            raise ConfigError(f"max-restarts: must be >= 0, got {self.max_restarts}")
        if self.window_s <= 0 or self.stable_s <= 0:
            raise ConfigError(
                f"restart window and stable time must be > 0, got {self.window_s} and"
                f" {self.stable_s}"
            )


class Action(enum.Enum):
    """What to do about a process that exited."""

    RESTART = "restart"
    GIVE_UP = "give_up"


@dataclass(frozen=True, slots=True)
class Decision:
    """The supervisor's answer to one exit."""

    action: Action
    # Seconds to wait before the restart (RESTART only).
    delay_s: float = 0.0
    # Why (GIVE_UP: the message an operator reads).
    reason: str = ""


class RestartHistory:
    """One process's exits and the decisions they lead to."""

    def __init__(self, policy: RestartPolicy | None = None) -> None:
        self.policy = policy or RestartPolicy()
        self._started_at: float | None = None
        self._exits: deque[float] = deque()
        # Consecutive exits of a process that never stayed up `stable_s`.
        self._num_unstable = 0
        self.num_restarts = 0

    def on_start(self, now: float) -> None:
        """The process was (re)started at `now`."""
        self._started_at = now

    def on_restart(self, now: float) -> None:
        """A restart the last decision asked for happened at `now`."""
        self.num_restarts += 1
        self.on_start(now)

    def on_exit(self, now: float, returncode: int | None) -> Decision:
        """The process exited at `now` with `returncode` (negative: killed by that signal)."""
        p = self.policy
        uptime = None if self._started_at is None else now - self._started_at
        self._started_at = None
        self._num_unstable = 1 if uptime is None or uptime >= p.stable_s else self._num_unstable + 1
        self._exits.append(now)
        while self._exits and self._exits[0] < now - p.window_s:
            self._exits.popleft()
        if len(self._exits) > p.max_restarts:
            return Decision(
                Action.GIVE_UP,
                reason=(
                    f"exited {len(self._exits)} times within {p.window_s:g} s (last: "
                    f"{describe_exit(returncode)}): a crash loop, not restarted"
                ),
            )
        delay = min(p.initial_backoff_s * p.factor ** (self._num_unstable - 1), p.max_backoff_s)
        return Decision(Action.RESTART, delay_s=delay)


def describe_exit(returncode: int | None) -> str:
    """ "exit code 1", "killed by signal 9", or "unknown status"."""
    if returncode is None:
        return "unknown status"
    if returncode < 0:
        return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class Liveness:
    """Whether a running process still answers its health probes."""

    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ConfigError(f"liveness-timeout-s: must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._failing_since: float | None = None
        self._declared = False

    def reset(self) -> None:
        """A new process: nothing known about it yet."""
        self._failing_since = None
        self._declared = False

    def on_probe(self, now: float, ok: bool) -> bool:
        """Record one probe; True exactly once per episode of `timeout_s` without an answer."""
        if ok:
            self.reset()
            return False
        if self._failing_since is None:
            self._failing_since = now
        if not self._declared and now - self._failing_since >= self.timeout_s:
            self._declared = True
            return True
        return False
