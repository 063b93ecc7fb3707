"""The supervisor: starts a cluster's processes, restarts the ones that die, gives up on loops.

Each child is a `ChildSpec` (a pdserve process run as `python -m ...` with a ready file, or a
whole command such as etcd) and lives through these states:

    STARTING ──ready──► RUNNING ──exit / liveness kill──► BACKOFF ──delay──► STARTING
        │                                  └──crash loop──► GIVEN_UP (stays down, says why)
        └──exit before its first ready──► GIVEN_UP (a process that never started is a
                                           launch error, not something to retry)

Ready means: the ready file names the URL (pdserve processes) and GET /health answers 200 (or
etcd's /health says true). Once a child is first ready, `pin` rewrites its command line with
the ports it got (`--port 0` becomes the real port), so a restart comes back at the same
address: static membership lists and clients keep working, and an etcd registration with the
same value is taken over at once. A restarted worker must report the fingerprint digest it had
before; one that does not (the model changed on disk) is stopped and given up, never rejoined.
RUNNING children are probed every `probe_interval_s`; one that answers nothing for the
liveness timeout (hung, or SIGSTOPped) is SIGKILLed and restarted like any exit.

Decisions come from `policy.py`; this module does the I/O: processes (always by PID, each in
its own session), ready files, health probes on a small thread pool (so a hung child never
blocks the loop), and the `notify` messages. `step` is the whole loop body; `run_in_thread`
calls it every 0.1 s for a caller that has other work (the soak), `pdserve up` calls it itself.
Thread-safe: the lock guards the children table, so another thread may read PIDs and signal
processes (the soak's nemesis) while the supervisor runs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import json
import os
import signal
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from pdserve.supervise.policy import Action, Liveness, RestartHistory, RestartPolicy, describe_exit
from pdserve.supervise.process import (
    Child,
    LaunchError,
    spawn_child,
    spawn_command,
    stop_children,
)

# Seconds one health probe may take.
PROBE_TIMEOUT_S = 2.0


class ChildKind(enum.StrEnum):
    """What a child is (the nemesis and `status` group children by it)."""

    WORKER = "worker"
    ROUTER = "router"
    ETCD = "etcd"


class ChildState(enum.StrEnum):
    """Where a supervised child is in its life cycle (see the module docstring)."""

    STARTING = "starting"
    RUNNING = "running"
    BACKOFF = "backoff"
    GIVEN_UP = "given_up"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """How to start one child."""

    name: str
    kind: ChildKind
    # `python -m` arguments of a pdserve process (a --ready-file is added), or with
    # `command=True` a whole command line.
    argv: tuple[str, ...]
    command: bool = False
    # Command prefix the process runs under (e.g. `ip netns exec NS`; it must exec, so the
    # PID is the process's own).
    wrap: tuple[str, ...] = ()
    # OMP_NUM_THREADS for the child (see `process.spawn_child`).
    threads: int | None = None
    # Where /health answers, for a child without a ready file (etcd).
    health_url: str | None = None


@dataclass(frozen=True, slots=True)
class ChildStatus:
    """One child as `status` and the state file show it."""

    name: str
    kind: str
    state: str
    pid: int | None
    url: str | None
    num_restarts: int
    last_exit: str | None
    reason: str | None
    pids: tuple[int, ...]


@dataclass(slots=True)
class _Supervised:
    spec: ChildSpec
    history: RestartHistory
    liveness: Liveness | None
    child: Child | None = None
    state: ChildState = ChildState.STARTING
    url: str | None = None
    restart_at: float = 0.0
    ever_ready: bool = False
    fingerprint: str | None = None
    last_exit: str | None = None
    reason: str | None = None
    pids: list[int] = field(default_factory=list)
    probe: concurrent.futures.Future[dict[str, object] | None] | None = None
    last_probe_at: float = 0.0


# Rewrites a child's spec once its first start is ready: (spec, its URL, its /health answer).
Pin = Callable[[ChildSpec, str, dict[str, object]], ChildSpec]


def _probe(url: str, tls: ssl.SSLContext | None = None) -> dict[str, object] | None:
    """GET /health (presenting `tls` to an https:// child): the JSON answer, or None when it
    did not answer 200 in time."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=PROBE_TIMEOUT_S, context=tls) as resp:
            body = json.loads(resp.read())
            return body if resp.status == 200 and isinstance(body, dict) else None
    except (OSError, ValueError):
        return None


class Supervisor:
    """Keeps a set of children running (see the module docstring)."""

    def __init__(
        self,
        workdir: Path,
        policy: RestartPolicy | None = None,
        liveness_timeout_s: float | None = None,
        pin: Pin | None = None,
        notify: Callable[[str], None] | None = None,
        on_change: Callable[[], None] | None = None,
        probe_interval_s: float = 1.0,
        env: Mapping[str, str] | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.workdir = workdir
        # The cluster's client TLS context (`--tls-*`): probes of https:// children present it.
        self._tls = tls
        # Extra environment of every child (the cluster secret: never on a command line).
        self._env = dict(env or {})
        self.policy = policy or RestartPolicy()
        self._liveness_timeout_s = liveness_timeout_s
        self._pin = pin
        self._notify = notify or (lambda message: None)
        self._on_change = on_change or (lambda: None)
        self._probe_interval_s = probe_interval_s
        self._children: dict[str, _Supervised] = {}
        self._lock = threading.RLock()
        self._pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="probe")
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # ---- queries ----------------------------------------------------------------------------

    def pid(self, name: str) -> int | None:
        """The PID of `name`'s current process while it runs, else None."""
        with self._lock:
            s = self._children[name]
            if s.child is None or s.child.proc.poll() is not None:
                return None
            return s.child.proc.pid

    def state(self, name: str) -> ChildState:
        """Where `name` is in its life cycle."""
        with self._lock:
            return self._children[name].state

    def url(self, name: str) -> str | None:
        """The URL `name` serves at (known once it was first ready)."""
        with self._lock:
            return self._children[name].url

    def names(self, kind: ChildKind | None = None) -> list[str]:
        """Children in start order, optionally of one kind."""
        with self._lock:
            return [n for n, s in self._children.items() if kind is None or s.spec.kind is kind]

    def statuses(self) -> list[ChildStatus]:
        """Every child as the state file shows it."""
        with self._lock:
            return [
                ChildStatus(
                    name,
                    s.spec.kind.value,
                    s.state.value,
                    s.child.proc.pid if s.child and s.child.proc.poll() is None else None,
                    s.url,
                    s.history.num_restarts,
                    s.last_exit,
                    s.reason,
                    tuple(s.pids),
                )
                for name, s in self._children.items()
            ]

    def all_pids(self) -> list[int]:
        """Every PID this supervisor ever started (to check none is left behind)."""
        with self._lock:
            return [pid for s in self._children.values() for pid in s.pids]

    # ---- starting ---------------------------------------------------------------------------

    def start(self, spec: ChildSpec) -> None:
        """Start a child now; `wait_ready` waits for it."""
        liveness = Liveness(self._liveness_timeout_s) if self._liveness_timeout_s else None
        with self._lock:
            s = _Supervised(spec, RestartHistory(self.policy), liveness)
            self._children[spec.name] = s
            self._spawn(s, time.monotonic())

    def wait_ready(self, names: list[str], deadline: float) -> None:
        """Step until every named child is RUNNING; LaunchError when one cannot start."""
        while True:
            self.step(time.monotonic())
            with self._lock:
                states = {n: self._children[n] for n in names}
            failed = [s for s in states.values() if s.state is ChildState.GIVEN_UP]
            if failed:
                raise LaunchError("; ".join(f"{s.spec.name}: {s.reason}" for s in failed))
            if all(s.state is ChildState.RUNNING for s in states.values()):
                return
            if time.monotonic() > deadline:
                late = [n for n, s in states.items() if s.state is not ChildState.RUNNING]
                raise LaunchError(f"{', '.join(late)} not healthy in time (logs in {self.workdir})")
            time.sleep(0.05)

    def _spawn(self, s: _Supervised, now: float) -> None:
        spec = s.spec
        if spec.command:
            s.child = spawn_command(spec.name, spec.argv, self.workdir, spec.wrap)
        else:
            s.child = spawn_child(
                spec.name, list(spec.argv), self.workdir, spec.threads, spec.wrap, self._env
            )
        s.pids.append(s.child.proc.pid)
        s.state = ChildState.STARTING
        s.probe = None
        if s.liveness is not None:
            s.liveness.reset()
        if s.ever_ready:
            s.history.on_restart(now)
        else:
            s.history.on_start(now)

    # ---- the loop ---------------------------------------------------------------------------

    def step(self, now: float) -> None:
        """One pass: notice exits, restart what is due, check readiness and liveness."""
        changed = False
        with self._lock:
            for s in self._children.values():
                changed |= self._step_one(s, now)
        if changed:
            self._on_change()

    def _step_one(self, s: _Supervised, now: float) -> bool:
        if s.state in (ChildState.GIVEN_UP, ChildState.STOPPED):
            return False
        if s.state is ChildState.BACKOFF:
            if now < s.restart_at:
                return False
            self._spawn(s, now)
            self._notify(
                f"{s.spec.name}: restarted (pid {self._pid(s)}, restart {s.history.num_restarts})"
            )
            return True
        assert s.child is not None
        code = s.child.proc.poll()
        if code is not None:
            return self._exited(s, now, code)
        if s.state is ChildState.STARTING:
            return self._check_ready(s)
        return self._check_live(s, now)

    def _exited(self, s: _Supervised, now: float, code: int) -> bool:
        s.last_exit = describe_exit(code)
        log = self.workdir / f"{s.spec.name}.log"
        if not s.ever_ready:
            s.state = ChildState.GIVEN_UP
            s.reason = f"exited with {s.last_exit} before it was ready; see {log}"
            self._notify(f"{s.spec.name} (pid {self._pid(s)}): {s.reason}")
            return True
        decision = s.history.on_exit(now, code)
        if decision.action is Action.GIVE_UP:
            s.state = ChildState.GIVEN_UP
            s.reason = f"{decision.reason}; see {log}"
            self._notify(f"{s.spec.name}: {s.reason}")
        else:
            s.state = ChildState.BACKOFF
            s.restart_at = now + decision.delay_s
            self._notify(
                f"{s.spec.name} (pid {self._pid(s)}) {s.last_exit}; restarting in"
                f" {decision.delay_s:.1f} s"
            )
        return True

    def _pid(self, s: _Supervised) -> int | None:
        return s.child.proc.pid if s.child is not None else None

    def _url_of(self, s: _Supervised) -> str | None:
        if s.spec.health_url is not None:
            return s.spec.health_url
        if s.url is not None:
            return s.url
        assert s.child is not None
        with contextlib.suppress(OSError, ValueError, KeyError):
            return str(json.loads(s.child.ready_file.read_text())["url"])
        return None

    def _check_ready(self, s: _Supervised) -> bool:
        if s.probe is None:
            url = self._url_of(s)
            if url is not None:
                s.probe = self._pool.submit(_probe, url, self._tls)
            return False
        if not s.probe.done():
            return False
        health, s.probe = s.probe.result(), None
        if health is None:
            return False
        url = self._url_of(s)
        assert url is not None and s.child is not None
        s.child.url = url
        digest = health.get("fingerprint_digest")
        if s.ever_ready and s.fingerprint is not None and digest != s.fingerprint:
            s.state = ChildState.GIVEN_UP
            s.reason = (
                f"restarted with fingerprint {str(digest)[:12]}, expected {s.fingerprint[:12]}"
                " (model or flags changed?): stopped, not rejoining its pool"
            )
            stop_children([s.child], grace_s=5.0)
            self._notify(f"{s.spec.name}: {s.reason}")
            return True
        if not s.ever_ready:
            s.ever_ready = True
            s.url = url
            s.fingerprint = digest if isinstance(digest, str) else None
            if self._pin is not None:
                s.spec = self._pin(s.spec, url, health)
        s.state = ChildState.RUNNING
        s.last_probe_at = time.monotonic()
        return True

    def _check_live(self, s: _Supervised, now: float) -> bool:
        if s.liveness is None:
            return False
        if s.probe is None:
            if now - s.last_probe_at >= self._probe_interval_s and (url := self._url_of(s)):
                s.probe = self._pool.submit(_probe, url, self._tls)
                s.last_probe_at = now
            return False
        if not s.probe.done():
            # A probe that has not returned is a failed one once its timeout passed.
            if now - s.last_probe_at < PROBE_TIMEOUT_S + 0.5:
                return False
            ok = False
        else:
            ok = s.probe.result() is not None
        s.probe = None
        if s.liveness.on_probe(now, ok):
            assert s.child is not None
            self._notify(
                f"{s.spec.name} (pid {s.child.proc.pid}): no health answer for"
                f" {s.liveness.timeout_s:g} s; killing it"
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(s.child.proc.pid, signal.SIGKILL)
        return False

    # ---- background loop and stop -----------------------------------------------------------

    def run_in_thread(self, interval_s: float = 0.1) -> None:
        """Call `step` every `interval_s` on a thread until `stop`."""

        def loop() -> None:
            while not self._stopping.wait(interval_s):
                self.step(time.monotonic())

        self._thread = threading.Thread(target=loop, name="supervisor", daemon=True)
        self._thread.start()

    def stop(self, order: list[str] | None = None, grace_s: float = 10.0) -> None:
        """Stop supervising, then every child by PID (in `order`, default reverse start)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(10.0)
        with self._lock:
            names = order or list(reversed(self._children))
            children = []
            for name in names:
                s = self._children[name]
                s.state = ChildState.STOPPED
                if s.child is not None:
                    children.append(s.child)
            for child in children:  # a stopped (SIGSTOP) process would not see SIGTERM
                if child.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child.proc.pid, signal.SIGCONT)
            stop_children(children, grace_s)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._on_change()


def with_argv(spec: ChildSpec, argv: list[str]) -> ChildSpec:
    """`spec` with another command line."""
    return replace(spec, argv=tuple(argv))
