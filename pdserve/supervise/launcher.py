"""`pdserve up`: routers and their workers as child processes on one host, kept up together.

Life cycle: start every worker (port 0, each reports its real URL through a ready file), wait
until each answers /health, start the routers with their URLs (or with the etcd membership the
workers registered in), wait for them, print the URLs and a curl line, then supervise until
Ctrl-C / SIGTERM: a child that dies is restarted with backoff at the same address (its ports
are pinned after the first start), a restarted worker must keep its fingerprint, a crash loop
is given up with a message saying why, a child that answers no health probe for the liveness
timeout is killed and restarted (`supervise/`). Stopping sends SIGTERM to every child by PID
(routers first), waits, and SIGKILLs what is left, so no process and no port outlives `up`.
The state file (`pdserve status` reads it) lists every child with its restarts.

Decode workers run with role `both`: they take transferred KV in disaggregated mode and whole
requests in colocated mode, which is what makes the rollback switch (`POST /admin/mode`) work
without restarting anything. With `--mode auto` every worker is `both` (no prefill-only ones)
and the router gives them prefill and decode roles itself when interference calls for it.

Membership: the routers get the workers' URLs (static), or with `--etcd` a local etcd is
started (and supervised) and every worker registers there, or with `--discovery URI` an
existing etcd is used.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from urllib.parse import urlsplit
from urllib.request import urlopen

from pdserve.auth.keys import ADMIN_KEY_FILE, API_KEY_FILE, BearerKey, key_environment
from pdserve.auth.secret import ENV_VAR, new_secret_text, write_secret_file
from pdserve.auth.tls import TLSConfig, client_context
from pdserve.config import BLOCK_SIZE, DTYPE, MODEL
from pdserve.errors import ConfigError
from pdserve.flag_types import non_negative_float, non_negative_int, positive_int
from pdserve.flag_types import port as port_number
from pdserve.membership.uri import DISCOVERY, parse_discovery
from pdserve.settings import repeated, setting
from pdserve.supervise.policy import RestartPolicy
from pdserve.supervise.process import (
    Child,
    LaunchError,
    spawn_child,
    stop_children,
    wait_child_ready,
    worker_threads,
)
from pdserve.supervise.supervisor import ChildKind, ChildSpec, ChildState, Supervisor

__all__ = [
    "Child",
    "Cluster",
    "LaunchError",
    "UpConfig",
    "default_state_file",
    "run_up",
    "spawn_child",
    "stop_children",
    "wait_child_ready",
    "worker_threads",
]

UP_MODES = ("disagg", "colocated", "auto")


@dataclass(frozen=True, slots=True)
class UpConfig:
    """What `pdserve up` starts."""

    # The flags `pdserve up` lists first, in this order (`cli/up.py`).
    # Flag not given: 1, or 0 with --mode auto (`cli/up.py` resolves it).
    num_prefill: int = setting(
        1,
        name="prefill",
        type=non_negative_int,
        to_flag=lambda n: None,
        help="prefill workers (default 1; 0 with --mode auto)",
    )
    num_decode: int = setting(
        1, name="decode", type=positive_int, help="decode workers (role both)"
    )
    mode: str = setting(
        "disagg",
        choices=UP_MODES,
        help="auto: the router splits the `both` workers into prefill and decode roles itself",
    )
    # Extra `pdserve router` flags (e.g. ("--routing", "round_robin") for a benchmark); on the
    # command line only those of --router-arg (`cli/up.py` adds the policy flags it was given).
    router_args: tuple[str, ...] = repeated(
        "router-arg",
        metavar="FLAG",
        help="extra `pdserve router` flag, e.g. --router-arg=--slo-tpot-ms=30 (repeatable)",
    )
    model: str | None = setting(None, MODEL)
    dtype: str = setting("float32", DTYPE)
    block_size: int = setting(16, BLOCK_SIZE)
    host: str = setting("127.0.0.1")
    # The first router's port; router i listens on port + i (0: each picks a free port).
    port: int = setting(8000, type=port_number, help="first router's port (then +1, ...)")
    # Handed to the routers in their environment, never on their command lines.
    api_key: BearerKey | None = setting(
        None, API_KEY_FILE, help="the routers' /v1 key (else $PDSERVE_API_KEY; none: open)"
    )
    admin_key: BearerKey | None = setting(
        None,
        ADMIN_KEY_FILE,
        help="the routers' /admin and /debug key (else $PDSERVE_ADMIN_KEY; none: loopback only)",
    )
    # The flags listed after the router's and the engines'.
    num_routers: int = setting(1, name="routers", type=positive_int, help="routers (one port each)")
    # Start (and supervise) an etcd on `etcd_host` for the membership.
    local_etcd: bool = setting(
        False,
        name="etcd",
        action="store_true",
        help="start a local etcd; workers register, routers watch",
    )
    # Workers register in this etcd and routers watch it (None: static URLs, or `local_etcd`).
    discovery: str | None = setting(None, DISCOVERY, help="an existing etcd")
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    # The cluster's TLS files (`--tls-*`, passed on to every router and worker); the health
    # probes present its client context.
    tls: TLSConfig = field(default_factory=TLSConfig)
    # Seconds without a health answer before a child is killed and restarted (None: never).
    liveness_timeout_s: float | None = setting(
        30.0,
        type=non_negative_float,
        to_field=lambda s: s or None,
        help="kill and restart a process that answers no health probe this long (0: never)",
    )
    startup_timeout_s: float = 180.0
    # Where the running cluster is described for `pdserve status`.
    state_file: Path = field(default_factory=lambda: default_state_file())
    # Extra `pdserve worker` flags, given to every worker (e.g. ("--max-num-seqs", "8")).
    worker_args: tuple[str, ...] = ()
    etcd_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.mode not in UP_MODES:
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
        if self.num_routers < 1:
            raise ConfigError(f"routers: at least one router is needed, got {self.num_routers}")
        if self.port and self.port + self.num_routers - 1 > 65535:
            raise ConfigError(f"port: {self.num_routers} routers from port {self.port} pass 65535")
        if self.discovery is not None:
            parse_discovery(self.discovery)
            if self.local_etcd:
                raise ConfigError("etcd: give --etcd (a local etcd) or --discovery, not both")
        if self.liveness_timeout_s is not None and self.liveness_timeout_s <= 0:
            raise ConfigError(
                f"liveness-timeout-s: must be > 0 (or off), got {self.liveness_timeout_s}"
            )


def default_state_file() -> Path:
    """The file `pdserve up` writes and `pdserve status` reads."""
    base = os.environ.get("PDSERVE_CACHE") or str(Path.home() / ".cache" / "pdserve")
    return Path(base) / "up.json"


def worker_specs(config: UpConfig, discovery: str | None) -> list[ChildSpec]:
    """The workers of `config`: prefill-i (role prefill), decode-i (role both)."""
    c = config
    names = [(f"prefill-{i}", "prefill") for i in range(c.num_prefill)]
    names += [(f"decode-{i}", "both") for i in range(c.num_decode)]
    threads = worker_threads(len(names))
    specs = []
    for name, role in names:
        args = ["pdserve.worker.main", "--role", role, "--host", c.host, "--port", "0"]
        args += ["--kv-port", "0", "--worker-id", name, "--dtype", c.dtype]
        args += ["--block-size", str(c.block_size)]
        args += ["--model", c.model] if c.model else []
        args += ["--discovery", discovery] if discovery else []
        specs.append(ChildSpec(name, ChildKind.WORKER, (*args, *c.worker_args), threads=threads))
    return specs


def router_specs(
    config: UpConfig, worker_urls: list[str], discovery: str | None
) -> list[ChildSpec]:
    """The routers of `config`, over the workers' URLs or the etcd membership."""
    c = config
    specs = []
    for i in range(c.num_routers):
        port = c.port + i if c.port else 0
        args = ["pdserve.router.main", "--host", c.host, "--port", str(port), "--mode", c.mode]
        if discovery:
            args += ["--discovery", discovery]
        else:
            for url in worker_urls:
                args += ["--worker", url]
        args += ["--model", c.model] if c.model else []
        name = "router" if c.num_routers == 1 else f"router-{i}"
        specs.append(ChildSpec(name, ChildKind.ROUTER, (*args, *c.router_args)))
    return specs


def _replace_flag(argv: tuple[str, ...], flag: str, value: str) -> tuple[str, ...]:
    """`argv` with the value after `flag` replaced (the last occurrence wins in argparse)."""
    out = list(argv)
    for i in range(len(out) - 1):
        if out[i] == flag:
            out[i + 1] = value
    return tuple(out)


def pin_ports(spec: ChildSpec, url: str, health: dict[str, object]) -> ChildSpec:
    """`spec` with the ports its first start got, so a restart comes back at the same address."""
    if spec.kind is ChildKind.ETCD:
        return spec
    argv = _replace_flag(spec.argv, "--port", str(urlsplit(url).port))
    transfer = health.get("transfer_address")
    if spec.kind is ChildKind.WORKER and isinstance(transfer, str):
        argv = _replace_flag(argv, "--kv-port", transfer.rpartition(":")[2])
    return dataclasses.replace(spec, argv=argv)


class Cluster:
    """The supervised processes of one `pdserve up`."""

    def __init__(
        self,
        config: UpConfig,
        place_worker: Callable[[ChildSpec], ChildSpec] | None = None,
        workdir: Path | None = None,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        # One secret per cluster (the caller's PDSERVE_CLUSTER_SECRET if set), readable by this
        # user only in the work folder; children get it in their environment, never in argv.
        self.secret = os.environ.get(ENV_VAR) or new_secret_text()
        # The key that signs calls to this cluster's workers (soak, benchmarks).
        self.http_key = write_secret_file(self.workdir / "cluster-secret", self.secret).key("http")
        # Rewrites a worker's spec before it starts (the soak runs each in a namespace).
        self._place_worker = place_worker or (lambda spec: spec)
        self.supervisor = Supervisor(
            self.workdir,
            config.restart,
            config.liveness_timeout_s,
            pin=pin_ports,
            notify=notify or (lambda message: print(f"pdserve up: {message}", file=sys.stderr)),
            on_change=self._write_state,
            env={ENV_VAR: self.secret, **key_environment(config.api_key, config.admin_key)},
            tls=client_context(config.tls),
        )
        self.discovery: str | None = config.discovery
        self.router_urls: list[str] = []
        self.worker_urls: list[str] = []

    @property
    def router_url(self) -> str | None:
        """The first router's URL (None before start)."""
        return self.router_urls[0] if self.router_urls else None

    def start(self) -> str:
        """Start etcd (if asked), workers, then routers; returns the first router's URL."""
        c = self.config
        deadline = time.monotonic() + c.startup_timeout_s
        sup = self.supervisor
        if c.local_etcd:
            from pdserve.supervise.etcd import discovery_uri, etcd_spec

            spec = etcd_spec(self.workdir, c.etcd_host)
            sup.start(spec)
            sup.wait_ready([spec.name], deadline)
            self.discovery = discovery_uri(spec)
        workers = [self._place_worker(s) for s in worker_specs(c, self.discovery)]
        for spec in workers:
            sup.start(spec)
        sup.wait_ready([s.name for s in workers], deadline)
        self.worker_urls = [sup.url(s.name) or "" for s in workers]
        routers = router_specs(c, self.worker_urls, self.discovery)
        for spec in routers:
            sup.start(spec)
        sup.wait_ready([s.name for s in routers], deadline)
        self.router_urls = [sup.url(s.name) or "" for s in routers]
        self._write_state()
        return self.router_urls[0]

    def _write_state(self) -> None:
        if not self.router_urls:
            return
        state = {
            "router_url": self.router_urls[0],
            "router_urls": self.router_urls,
            "pid": os.getpid(),
            # The operator commands (`pdserve status`, `top`, `trace`, `drain`) dial with these.
            "tls": {k: str(v) for k, v in dataclasses.asdict(self.config.tls).items() if v},
            "children": [dataclasses.asdict(s) for s in self.supervisor.statuses()],
        }
        path = self.config.state_file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, path)

    def stop(self) -> None:
        """Stop the routers first (no new requests), then the workers, then etcd."""
        sup = self.supervisor
        order = [
            *sup.names(ChildKind.ROUTER),
            *sup.names(ChildKind.WORKER),
            *sup.names(ChildKind.ETCD),
        ]
        sup.stop(order)
        if self.config.state_file.exists():
            try:
                if json.loads(self.config.state_file.read_text()).get("pid") == os.getpid():
                    self.config.state_file.unlink()
            except (OSError, ValueError):
                pass

    def wait(self) -> int:
        """Supervise until a signal (0), or until no router is left to restart (1)."""
        stop = {"signal": 0}

        def on_signal(signum: int, frame: FrameType | None) -> None:
            stop["signal"] = signum

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        sup = self.supervisor
        while not stop["signal"]:
            sup.step(time.monotonic())
            routers = sup.names(ChildKind.ROUTER)
            if all(sup.state(r) is ChildState.GIVEN_UP for r in routers):
                print("pdserve up: no router left to restart; stopping", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0


def check_router_args(config: UpConfig) -> None:
    """Parse the router's flags as the router will, before any process starts: a bad
    `--router-arg` (an SLO out of range, say) is refused now, naming the flag, instead of
    after the workers are up."""
    from pdserve.router.main import config_from_args

    # The routers will get the cluster's secret in their environment, made after this check:
    # a stand-in file gives the check one (a `--cluster-secret-file` in the router's own
    # flags comes later in argv and is checked instead).
    with tempfile.TemporaryDirectory(prefix="pdserve-check-") as folder:
        stand_in = Path(folder) / "cluster-secret"
        write_secret_file(stand_in, new_secret_text())
        args = ["--worker", "http://127.0.0.1:1", "--mode", config.mode]
        args += ["--cluster-secret-file", str(stand_in), *config.router_args]
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
        with urlopen(f"{url}/health", timeout=5, context=client_context(config.tls)) as resp:
            model = json.loads(resp.read()).get("model", "pdserve")
        # The key's variable, never its value: this line lands in terminals and logs.
        auth = ' -H "Authorization: Bearer $PDSERVE_API_KEY"' if config.api_key else ""
        # Signed by the cluster CA, which curl does not trust, and mutual: curl presents one.
        tls = config.tls
        if tls.ca is not None:
            auth += f" --cacert {tls.ca} --cert {tls.cert} --key {tls.key}"
        routers = ", ".join(cluster.router_urls)
        membership = f"etcd {cluster.discovery}" if cluster.discovery else "static"
        print(
            f"pdserve is up at {routers}  (mode {config.mode}, {config.num_prefill} prefill, "
            f"{config.num_decode} decode, membership {membership}; processes restarted when"
            f" they die; logs in {cluster.workdir})"
        )
        print(
            f"curl {url}/v1/completions -H 'Content-Type: application/json'{auth} "
            f"""-d '{{"model": "{model}", "prompt": "The quick brown fox", "max_tokens": 16}}'""",
            flush=True,
        )
        return cluster.wait()
    finally:
        cluster.stop()
