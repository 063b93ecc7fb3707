"""`pdserve chaos --soak DURATION`: sustained load under a seeded nemesis, a history, a verdict.

One run, everything stopped by PID at the end:

    plans (load and faults, from the seed) → references (an in-process engine)
      → cluster: local etcd, 2 prefill + 2 decode workers (each in its own network namespace
        where the machine allows), 2 routers, all supervised (`launcher.Cluster`)
      → warm-up → pinned blocks at idle
      → fault-free phase: the plan's first `fault_free_s` seconds of load, no fault
      → soak: the whole plan's load for DURATION while the nemesis applies its faults
      → heal, wait until every process runs again, one lease TTL → quiescence per worker
      → stop → processes left → history (JSON lines) → checker → report (+ plots)

The checker (`soak_check`) is pure, so `--check HISTORY` judges a stored history again.
Same seed, duration, rate and nemesis: the same requests and faults at the same offsets.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from pdlab.netlab import Lab, lab, probe_netns
from pdlab.soak.check import check
from pdlab.soak.history import (
    History,
    Phase,
    Quiescence,
    RequestRecord,
    SoakMeta,
    SoakTargets,
    WorkerQuiescence,
)
from pdlab.soak.load import Endpoints, LoadRunner
from pdlab.soak.nemesis import Nemesis
from pdlab.soak.nemesis_plan import (
    ALL_FAULTS,
    ClusterShape,
    FaultKind,
    PlannedFault,
    plan_faults,
)
from pdlab.soak.plan import plan_load
from pdlab.soak.reference import Prepared, alone, prepare
from pdlab.soak.report import SoakResult, render_report, verdict_json, write_history
from pdserve.advise.client import Ending
from pdserve.errors import ConfigError, RouterError
from pdserve.model.config import load_config
from pdserve.router.workers.client import ClientTimeouts, WorkerClient
from pdserve.supervise.etcd import etcd_binary
from pdserve.supervise.launcher import Cluster, UpConfig
from pdserve.supervise.policy import RestartPolicy
from pdserve.supervise.process import pid_alive
from pdserve.supervise.supervisor import ChildKind, ChildSpec, ChildState

log = logging.getLogger(__name__)

SHAPE = ClusterShape(("prefill-0", "prefill-1"), ("decode-0", "decode-1"), ("router-0", "router-1"))
# Cluster settings: short leases so orphaned KV is freed within the run, and deadlines that
# fail over fast (see docs/design-notes.md § Nemesis soak).
LEASE_TTL_S = 4.0
REQUEST_TIMEOUT_S = 30.0
CHUNK_TIMEOUT_S = 0.5
HEALTH_DEADLINE_S = 2.0
MEMBERSHIP_TTL_S = 5
LIVENESS_TIMEOUT_S = 20.0


@dataclass(frozen=True, slots=True)
class SoakConfig:
    """What `pdserve chaos --soak` runs; every value checked, naming its flag."""

    duration_s: float
    rate: float = 1.0
    nemesis: tuple[FaultKind, ...] = ALL_FAULTS
    seed: int = 0
    # At least one fault starts within every interval of this many seconds.
    fault_interval_s: float = 8.0
    # Seconds of the fault-free phase (the goodput baseline; capped at the duration).
    fault_free_s: float = 30.0
    # A request must end (completed or a typed error) within this many seconds.
    deadline_s: float = REQUEST_TIMEOUT_S + 10.0
    model: str | None = None
    workdir: Path | None = None
    json_path: Path | None = None
    history_path: Path | None = None
    plot_dir: Path | None = None
    # Run workers in network namespaces when the machine allows (the partition fault needs it).
    use_netns: bool = True
    # The routers' lease TTL: a shorter one makes every pause of a few seconds outlive a lease.
    lease_ttl_s: float = LEASE_TTL_S
    targets: SoakTargets = field(default_factory=SoakTargets)

    def __post_init__(self) -> None:
        checks = (
            ("--soak", self.duration_s, 1.0, 24 * 3600.0),
            ("--rate", self.rate, 0.01, 100.0),
            ("--fault-interval-s", self.fault_interval_s, 0.5, 3600.0),
            ("--fault-free-s", self.fault_free_s, 0.0, 24 * 3600.0),
            ("--lease-ttl-s", self.lease_ttl_s, 0.2, 3600.0),
        )
        for flag, value, low, high in checks:
            if not (isinstance(value, int | float) and low <= value <= high):
                raise ConfigError(f"{flag}: must be in [{low:g}, {high:g}], got {value!r}")
        if not self.nemesis:
            raise ConfigError("--nemesis: no fault named")
        if not 0.0 <= self.targets.min_availability <= 1.0:
            raise ConfigError(
                f"--min-availability: must be in [0, 1], got {self.targets.min_availability}"
            )

    @property
    def fault_free_window_s(self) -> float:
        return min(self.fault_free_s, self.duration_s)


def parse_duration(text: str) -> float:
    """ "90", "90s", "10m", "1h" as seconds; ConfigError naming --soak otherwise."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    value = text.strip().lower()
    scale = units.get(value[-1:])
    number = value[:-1] if scale is not None else value
    try:
        seconds = float(number) * (scale or 1.0)
    except ValueError:
        raise ConfigError(f"--soak: {text!r} is not a duration (e.g. 90, 90s, 10m)") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"--soak: must be a positive duration, got {text!r}")
    return seconds


@contextlib.contextmanager
def _machines(config: SoakConfig) -> Iterator[tuple[Lab | None, str | None]]:
    """A network lab with one namespace per worker, or None and the reason there is none."""
    if not config.use_netns:
        yield None, "not asked for (--no-netns)"
        return
    reason = probe_netns()
    if reason is not None:
        yield None, reason
        return
    with lab([*SHAPE.prefill, *SHAPE.decode]) as machines:
        yield machines, None


def _placer(machines: Lab | None) -> Callable[[ChildSpec], ChildSpec]:
    """Where each worker runs: its own namespace and address when there is a lab."""

    def place(spec: ChildSpec) -> ChildSpec:
        if machines is None:
            return spec
        argv = list(spec.argv)
        argv[argv.index("--host") + 1] = machines.addresses[spec.name]
        return dataclasses.replace(spec, argv=tuple(argv), wrap=tuple(machines.wrap(spec.name)))

    return place


def _up_config(config: SoakConfig, workdir: Path, etcd_host: str) -> UpConfig:
    return UpConfig(
        num_prefill=len(SHAPE.prefill),
        num_decode=len(SHAPE.decode),
        num_routers=len(SHAPE.routers),
        model=config.model,
        port=0,
        local_etcd=True,
        etcd_host=etcd_host,
        worker_args=(
            "--enable-fault-admin",
            *("--transfer-chunk-timeout-s", str(CHUNK_TIMEOUT_S)),
            *("--membership-ttl-s", str(MEMBERSHIP_TTL_S)),
        ),
        router_args=(
            *("--lease-ttl-s", str(config.lease_ttl_s)),
            *("--request-timeout-s", str(REQUEST_TIMEOUT_S)),
            *("--health-deadline-s", str(HEALTH_DEADLINE_S)),
            *("--timeline-ring", "20000"),
        ),
        # Up to the whole run's kills of one process may come within a minute.
        restart=RestartPolicy(initial_backoff_s=0.2, max_backoff_s=2.0, max_restarts=30),
        liveness_timeout_s=LIVENESS_TIMEOUT_S,
        state_file=workdir / "up.json",
    )


async def _pinned(client: WorkerClient, cluster: Cluster) -> dict[str, WorkerQuiescence]:
    sup = cluster.supervisor
    found = {}
    for name in sup.names(ChildKind.WORKER):
        url = sup.url(name)
        try:
            h = await client.health(url or "")
            found[name] = WorkerQuiescence(
                name, True, h.num_pinned_blocks, h.num_pinned_blocks, h.num_running, h.num_waiting
            )
        except RouterError:
            found[name] = WorkerQuiescence(name, False)
    return found


async def _wait_all_running(cluster: Cluster, timeout_s: float) -> None:
    sup = cluster.supervisor
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [sup.state(n) for n in sup.names()]
        if all(s in (ChildState.RUNNING, ChildState.GIVEN_UP) for s in states):
            return
        await asyncio.sleep(0.2)


async def _warm_up(session: aiohttp.ClientSession, cluster: Cluster, model: str) -> None:
    """One greedy request through each router (loads every code path before anything counts)."""
    body = {"model": model, "prompt": "warm up", "max_tokens": 4, "temperature": 0}
    for url in cluster.router_urls:
        for _ in range(60):
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    if resp.status == 200:
                        await resp.read()
                        break
            await asyncio.sleep(0.5)


async def _run(
    config: SoakConfig,
    prepared: list[Prepared],
    faults: list[PlannedFault],
    workdir: Path,
    meta: SoakMeta,
) -> History:
    history = History(meta)
    with _machines(config) as (machines, missing):
        history.meta = dataclasses.replace(meta, netns_unavailable=missing)
        etcd_host = machines.root_address if machines is not None else "127.0.0.1"
        cluster = Cluster(
            _up_config(config, workdir, etcd_host),
            place_worker=_placer(machines),
            workdir=workdir / "cluster",
            notify=lambda message: log.warning("supervisor: %s", message),
        )
        started: list[int] = []
        try:
            await asyncio.to_thread(cluster.start)
            cluster.supervisor.run_in_thread()
            history = await _phases(config, cluster, prepared, faults, machines, missing, history)
        finally:
            started = cluster.supervisor.all_pids()
            await asyncio.to_thread(cluster.stop)
        left = tuple(f"pid {pid}" for pid in started if pid_alive(pid))
        history.quiescence = dataclasses.replace(history.quiescence, processes_left=left)
    return history


async def _phases(
    config: SoakConfig,
    cluster: Cluster,
    prepared: list[Prepared],
    faults: list[PlannedFault],
    machines: Lab | None,
    missing: str | None,
    history: History,
) -> History:
    sup = cluster.supervisor
    model = Path(config.model).name if config.model else _default_model().name
    workers = {sup.url(n) or "": n for n in sup.names(ChildKind.WORKER)}
    routers = tuple((n, sup.url(n) or "") for n in sup.names(ChildKind.ROUTER))
    endpoints = Endpoints(routers, workers)
    timeout = aiohttp.ClientTimeout(total=None)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        client = WorkerClient(session, ClientTimeouts(), key=cluster.http_key)
        await _warm_up(session, cluster, model)
        await asyncio.sleep(1.0)
        idle = await _pinned(client, cluster)
        load = LoadRunner(session, endpoints, config.deadline_s)
        log.info("soak: fault-free phase, %.0f s", config.fault_free_window_s)
        if config.fault_free_window_s > 0:
            history.requests += await load.run(
                prepared, Phase.FAULT_FREE, config.fault_free_window_s
            )
        log.info("soak: %.0f s under %d planned faults", config.duration_s, len(faults))
        nemesis = Nemesis(sup, client, machines, missing, seed=config.seed)
        t0 = asyncio.get_running_loop().time()
        applied, records = await asyncio.gather(
            nemesis.run(faults, t0), load.run(prepared, Phase.SOAK, config.duration_s)
        )
        history.faults = list(applied)
        history.requests += records
        await nemesis.heal()
        await _wait_all_running(cluster, timeout_s=120.0)
        # One lease TTL for what the faults orphaned, and the reaper's period.
        await asyncio.sleep(config.lease_ttl_s + 2.0)
        after = await _pinned(client, cluster)
    given_up = tuple(
        f"{s.name}: {s.reason}" for s in sup.statuses() if s.state == ChildState.GIVEN_UP.value
    )
    history.quiescence = Quiescence(
        workers=tuple(
            dataclasses.replace(
                after[name], pinned_idle=idle[name].pinned_idle if name in idle else 0
            )
            for name in sorted(after)
        ),
        given_up=given_up,
    )
    return history


def _differs(r: RequestRecord) -> bool:
    """Whether the tokens received are not (a prefix of, when cut short) the reference."""
    if r.malformed is not None or not r.token_ids:
        return False
    want = r.expected_token_ids
    if r.ending is Ending.COMPLETE:
        return r.token_ids != want
    return r.token_ids != want[: len(r.token_ids)]


def _second_opinions(history: History, prepared: list[Prepared], model_path: Path) -> None:
    """Add, to each request whose output differs from the batched reference, its output
    computed alone (see `soak_reference.alone`); the checker accepts either."""
    by_index = {p.planned.index: p for p in prepared}
    differing = [i for i, r in enumerate(history.requests) if _differs(r)]
    if not differing:
        return
    log.info("soak: %d outputs differ from the reference; computing them alone", len(differing))
    opinions = alone([by_index[history.requests[i].index] for i in differing], model_path)
    for i in differing:
        r = history.requests[i]
        tokens, text = opinions[r.index]
        if tokens != r.expected_token_ids:
            history.requests[i] = dataclasses.replace(
                r, alternative_token_ids=(tokens,), alternative_texts=(text,)
            )


def _default_model() -> Path:
    from pdserve.model.tiny import default_model_path

    return default_model_path()


async def run_soak_async(config: SoakConfig, command: str = "") -> SoakResult:
    """Plan, reference, run and judge one soak (see the module docstring)."""
    start = time.perf_counter()
    etcd_binary()  # no etcd: fail now, before any process starts
    workdir = config.workdir or Path(tempfile.mkdtemp(prefix="pdserve-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model_path = Path(config.model) if config.model else _default_model()
    max_model_len = load_config(model_path).max_position_embeddings
    plan = plan_load(config.seed, config.duration_s, config.rate)
    faults = plan_faults(
        config.seed, config.duration_s, config.nemesis, SHAPE, config.fault_interval_s
    )
    log.info("soak: %d requests and %d faults planned; references...", len(plan), len(faults))
    prepared = await asyncio.to_thread(prepare, plan, model_path, max_model_len)
    meta = SoakMeta(
        seed=config.seed,
        duration_s=config.duration_s,
        rate=config.rate,
        nemesis=tuple(k.value for k in config.nemesis),
        fault_interval_s=config.fault_interval_s,
        fault_free_s=config.fault_free_window_s,
        command=command,
        targets=config.targets,
    )
    history = await _run(config, prepared, faults, workdir, meta)
    await asyncio.to_thread(_second_opinions, history, prepared, model_path)
    verdict = check(history)
    return SoakResult(history, verdict, time.perf_counter() - start)


def run_soak(config: SoakConfig, command: str = "") -> int:
    """The `pdserve chaos --soak` command: 0 when every target held, 1 otherwise."""
    if config.plot_dir is not None:
        from pdserve.observability.plot import load_pyplot

        load_pyplot()  # a missing extra fails now, not after the soak
    result = asyncio.run(run_soak_async(config, command))
    _write_outputs(config, result)
    print(render_report(result))
    return 0 if result.verdict.passed else 1


def _write_outputs(config: SoakConfig, result: SoakResult) -> None:
    if config.history_path is not None:
        write_history(result.history, config.history_path)
    if config.json_path is not None:
        config.json_path.write_text(json.dumps(verdict_json(result), indent=2, default=str))
    if config.plot_dir is not None:
        from pdlab.soak.plot import save_soak_plot

        save_soak_plot(result.history, config.plot_dir / "soak.png")
