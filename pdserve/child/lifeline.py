"""A child's lifeline to the process that started it: when the starter dies, the child stops.

Children run in their own session (a terminal's Ctrl-C reaches only the launcher), so nothing
stops them when the launcher is SIGKILLed or crashes: they would keep their ports, their GPU
memory and their leases. The launcher therefore hands each child the read end of a pipe and
keeps the write end. The kernel closes the write end when the launcher dies, however it dies,
and the child's read then returns end-of-file: the child SIGTERMs itself (its graceful stop)
and, if that has not ended it after a grace period, exits.

A pipe rather than Linux's parent-death signal: that signal follows the *thread* that forked
(a launcher restarting a child from a helper thread would kill it when that thread ends), is
cleared by some execs, and needs a pre-exec hook, which is unsafe in a threaded parent.

    launcher: Lifeline() -> pass `child_fd` (pass_fds) and `environment()` to the child;
              close() once the child is reaped.
    child:    watch_lifeline() at start: nothing happens unless the environment names a fd.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping

ENV_VAR = "PDSERVE_LIFELINE_FD"
# Seconds a child whose starter died gets for its graceful stop before it exits anyway (a
# worker adds its drain timeout: it drains as on SIGTERM).
GRACE_S = 30.0

log = logging.getLogger(__name__)


class Lifeline:
    """The launcher's side: one pipe per child start."""

    def __init__(self) -> None:
        # os.pipe() fds are not inheritable: only `child_fd`, passed explicitly, reaches the
        # child, so no other child holds this one's write end open.
        self.child_fd, self._write_fd = os.pipe()
        self._closed = False

    def environment(self) -> dict[str, str]:
        """What to add to the child's environment."""
        return {ENV_VAR: str(self.child_fd)}

    def started(self) -> None:
        """The child has its copy of the read end: close the launcher's."""
        with contextlib.suppress(OSError):
            os.close(self.child_fd)

    def close(self) -> None:
        """Cut the lifeline (the child, if alive, stops): after the child was reaped."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(OSError):
                os.close(self._write_fd)


def _fd_from(environ: Mapping[str, str]) -> int | None:
    text = environ.get(ENV_VAR)
    if text is None:
        return None
    try:
        fd = int(text)
        os.fstat(fd)
    except (ValueError, OSError):
        log.warning("%s=%r names no open file descriptor: no lifeline watched", ENV_VAR, text)
        return None
    return fd


def _stop_self(grace_s: float) -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    log.error("still running %.0f s after its starter died: exiting", grace_s)
    os._exit(1)


def watch_lifeline(
    environ: Mapping[str, str] | None = None,
    on_lost: Callable[[], None] | None = None,
    grace_s: float = GRACE_S,
) -> threading.Thread | None:
    """In a child: watch the lifeline named in the environment, if any, on a daemon thread;
    when the starter dies, `on_lost()` (default: SIGTERM this process, then exit after
    `grace_s`). The thread, or None when there is no lifeline."""
    fd = _fd_from(os.environ if environ is None else environ)
    if fd is None:
        return None
    # Not passed on to this process's own children (os.set_inheritable is per fd).
    os.set_inheritable(fd, False)

    def watch() -> None:
        while True:
            try:
                data = os.read(fd, 1)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                break
        log.warning("the process that started this one is gone: stopping")
        if on_lost is not None:
            on_lost()
        else:
            _stop_self(grace_s)

    thread = threading.Thread(target=watch, name="lifeline", daemon=True)
    thread.start()
    return thread
