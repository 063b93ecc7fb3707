"""`pdserve up`: a router and its workers as child processes on loopback, started and stopped
as one unit.

Life cycle: start every worker (port 0, each reports its real URL through a ready file), wait
until each answers /health, start the router with their URLs, wait for it, print the URL and a
curl line, then wait for Ctrl-C / SIGTERM or for a child to die. Stopping sends SIGTERM to every
child by PID, waits, and SIGKILLs what is left, so no process and no port outlives `up`.

Decode workers run with role `both`: they take transferred KV in disaggregated mode and whole
requests in colocated mode, which is what makes the rollback switch (`POST /admin/mode`) work
without restarting anything. With `--mode auto` every worker is `both` (no prefill-only ones)
and the router gives them prefill and decode roles itself when interference calls for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from urllib.request import urlopen

from pdserve.auth.secret import ENV_VAR, new_secret_text, write_secret_file
from pdserve.errors import ConfigError, PdserveError


class LaunchError(PdserveError):
    """A child process failed to start or to become healthy."""


@dataclass(frozen=True, slots=True)
class UpConfig:
    """What `pdserve up` starts."""

    num_prefill: int = 1
    num_decode: int = 1
    mode: str = "disagg"
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "float32"
    block_size: int = 16
    api_key: str | None = None
    startup_timeout_s: float = 180.0
    # Extra `pdserve router` flags (e.g. ("--routing", "round_robin") for a benchmark).
    router_args: tuple[str, ...] = ()
    # Extra `pdserve worker` flags, given to every worker (e.g. ("--max-num-seqs", "8")).
    worker_args: tuple[str, ...] = ()
    # Where the running cluster is described for `pdserve status`.
    state_file: Path = field(default_factory=lambda: default_state_file())

    def __post_init__(self) -> None:
        if self.mode not in ("disagg", "colocated", "auto"):
            raise ConfigError(f"mode: {self.mode!r} is not one of disagg, colocated, auto")
        if self.mode == "auto" and self.num_prefill != 0:
            raise ConfigError(
                f"prefill: auto mode gives `both` workers their roles itself; start them with"
                f" --decode N and --prefill 0, got --prefill {self.num_prefill}"
            )
        if self.num_decode < 1:
            raise ConfigError(
                f"decode: at least one decode worker is needed, got {self.num_decode}"
            )
        if self.num_prefill < 0 or (self.mode == "disagg" and self.num_prefill < 1):
            raise ConfigError(
                f"prefill: disagg mode needs >= 1 prefill worker, got {self.num_prefill}"
            )


def default_state_file() -> Path:
    """The file `pdserve up` writes and `pdserve status` reads."""
    base = os.environ.get("PDSERVE_CACHE") or str(Path.home() / ".cache" / "pdserve")
    return Path(base) / "up.json"


@dataclass(slots=True)
class Child:
    """One started process and where it listens."""

    name: str
    proc: subprocess.Popen[bytes]
    ready_file: Path
    url: str | None = None


def worker_threads(num_workers: int) -> int:
    """Intra-op threads per worker so that `num_workers` engines on this host share its cores."""
    return max(1, (os.cpu_count() or 1) // max(1, num_workers))


def spawn_child(
    name: str,
    args: list[str],
    workdir: Path,
    threads: int | None = None,
    secret: str | None = None,
) -> Child:
    """Start `python -m ARGS --ready-file F` in its own session, logging to WORKDIR/NAME.log.

    `secret` is the cluster secret, handed over in the environment (`PDSERVE_CLUSTER_SECRET`),
    never on the command line, where `ps` would show it.

    `threads` sets the child's OMP_NUM_THREADS unless the caller's environment already does:
    torch starts one intra-op thread per core in every process, and several engines on one
    host then oversubscribe it (measured: 6 concurrent requests took 4.7 s instead of 0.2 s
    with four workers on two cores).
    """
    ready = workdir / f"{name}.ready.json"
    env = dict(os.environ)
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    if secret is not None:
        env[ENV_VAR] = secret
    log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115 - owned by the child's lifetime
    proc = subprocess.Popen(
        [sys.executable, "-m", *args, "--ready-file", str(ready)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        # Own session: a terminal Ctrl-C reaches only `up`, which stops children in order.
        start_new_session=True,
    )
    return Child(name, proc, ready)


def wait_child_ready(child: Child, deadline: float) -> str:
    """The child's URL once its ready file exists and /health answers 200 (before `deadline`)."""
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise LaunchError(
                f"{child.name} (pid {child.proc.pid}) exited with {child.proc.returncode} "
                f"before it was ready; see {child.ready_file.parent / (child.name + '.log')}"
            )
        if child.ready_file.exists():
            url = str(json.loads(child.ready_file.read_text())["url"])
            try:
                with urlopen(f"{url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return url
            except OSError:
                pass
        time.sleep(0.1)
    raise LaunchError(f"{child.name} (pid {child.proc.pid}) not healthy in time")


def stop_children(children: list[Child], grace_s: float = 10.0) -> None:
    """SIGTERM every child by PID, wait up to `grace_s`, SIGKILL the rest."""
    for child in children:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()


class Cluster:
    """The processes of one `pdserve up`."""

    def __init__(self, config: UpConfig) -> None:
        self.config = config
        self.children: list[Child] = []
        self.workdir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        self.router_url: str | None = None
        # One secret per cluster (the caller's PDSERVE_CLUSTER_SECRET if set), readable by this
        # user only in the work folder, so `pdserve status` and friends can sign calls.
        self.secret = os.environ.get(ENV_VAR) or new_secret_text()
        write_secret_file(self.workdir / "cluster-secret", self.secret)

    def _worker_args(self, role: str, name: str) -> list[str]:
        c = self.config
        args = ["pdserve.worker.main", "--role", role, "--host", c.host, "--port", "0"]
        args += ["--worker-id", name, "--dtype", c.dtype, "--block-size", str(c.block_size)]
        return args + (["--model", c.model] if c.model else []) + list(c.worker_args)

    def start(self) -> str:
        """Start workers then the router; returns the router URL."""
        c = self.config
        deadline = time.monotonic() + c.startup_timeout_s
        names = [(f"prefill-{i}", "prefill") for i in range(c.num_prefill)]
        names += [(f"decode-{i}", "both") for i in range(c.num_decode)]
        threads = worker_threads(len(names))
        workers = [
            spawn_child(n, self._worker_args(role, n), self.workdir, threads, self.secret)
            for n, role in names
        ]
        self.children.extend(workers)
        for w in workers:
            w.url = wait_child_ready(w, deadline)
        args = ["pdserve.router.main", "--host", c.host, "--port", str(c.port), "--mode", c.mode]
        for w in workers:
            args += ["--worker", w.url or ""]
        args += ["--model", c.model] if c.model else []
        args += ["--api-key", c.api_key] if c.api_key else []
        args += list(c.router_args)
        router = spawn_child("router", args, self.workdir, secret=self.secret)
        self.children.append(router)
        self.router_url = router.url = wait_child_ready(router, deadline)
        state = {
            "router_url": self.router_url,
            "pid": os.getpid(),
            "children": [
                {"name": ch.name, "pid": ch.proc.pid, "url": ch.url} for ch in self.children
            ],
        }
        c.state_file.parent.mkdir(parents=True, exist_ok=True)
        c.state_file.write_text(json.dumps(state, indent=2))
        return self.router_url

    def stop(self) -> None:
        """Stop the router first (no new requests), then the workers."""
        stop_children(list(reversed(self.children)))
        if self.config.state_file.exists():
            try:
                if json.loads(self.config.state_file.read_text()).get("pid") == os.getpid():
                    self.config.state_file.unlink()
            except (OSError, ValueError):
                pass

    def wait(self) -> int:
        """Block until a signal or a child exit; returns the exit status for `up`."""
        stop = {"signal": 0}

        def on_signal(signum: int, frame: FrameType | None) -> None:
            stop["signal"] = signum

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        while not stop["signal"]:
            for child in self.children:
                if child.proc.poll() is not None:
                    print(
                        f"pdserve up: {child.name} (pid {child.proc.pid}) exited with "
                        f"{child.proc.returncode}; stopping",
                        file=sys.stderr,
                    )
                    return 1
            time.sleep(0.2)
        return 0


def check_router_args(config: UpConfig) -> None:
    """Parse the router's flags as the router will, before any process starts: a bad
    `--router-arg` (an SLO out of range, say) is refused now, naming the flag, instead of
    after the workers are up."""
    from pdserve.router.main import config_from_args

    args = ["--worker", "http://127.0.0.1:1", "--mode", config.mode, *config.router_args]
    args += ["--model", config.model] if config.model else []
    try:
        config_from_args(args)
    except SystemExit:  # argparse already said why (an unknown flag, a bad number)
        raise ConfigError(
            f"router-arg: `pdserve router` refused {list(config.router_args)}"
        ) from None


def run_up(config: UpConfig) -> int:
    """The `pdserve up` command."""
    check_router_args(config)
    cluster = Cluster(config)
    try:
        url = cluster.start()
        with urlopen(f"{url}/health", timeout=5) as resp:
            model = json.loads(resp.read()).get("model", "pdserve")
        auth = f' -H "Authorization: Bearer {config.api_key}"' if config.api_key else ""
        print(
            f"pdserve is up at {url}  (mode {config.mode}, {config.num_prefill} prefill, "
            f"{config.num_decode} decode; logs in {cluster.workdir})"
        )
        print(
            f"curl {url}/v1/completions -H 'Content-Type: application/json'{auth} "
            f"""-d '{{"model": "{model}", "prompt": "The quick brown fox", "max_tokens": 16}}'""",
            flush=True,
        )
        return cluster.wait()
    finally:
        cluster.stop()
