"""The worker's typed configuration, built once by `main` from its flags.

A `WorkerConfig` is frozen and validated at construction (a bad value fails at start, naming
the field). The worker passes `engine` to the engine thread and keeps the rest for itself: the
engine never sees ports, roles or lease settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pdserve.auth.secret import (
    SECRET_FILE,
    ClusterKeys,
    ClusterSecret,
    require_secret,
)
from pdserve.auth.tls import TLSConfig
from pdserve.config import EngineConfig
from pdserve.errors import ConfigError
from pdserve.faults import parse_rules
from pdserve.membership.codec import check_worker_id
from pdserve.membership.uri import DISCOVERY, parse_discovery
from pdserve.settings import repeated, setting

ROLES = ("prefill", "decode", "both")
KV_TRANSPORTS = ("auto", "nixl", "shm", "tcp")
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass(frozen=True, slots=True)
class WorkerConfig(ClusterKeys):
    """One worker process: its role, its endpoints and its engine."""

    # "prefill" serves /prefill, "decode" serves /reserve and /decode, "both" serves all.
    role: str = setting("both", choices=ROLES)
    host: str = setting("127.0.0.1")
    # HTTP control port; 0 picks a free one (reported through `ready_file`).
    port: int = setting(0, help="HTTP port; 0 picks a free one")
    # KV transfer (TCP) port of a decode/both worker; 0 picks a free one.
    kv_port: int = setting(0, help="KV transfer port; 0 picks one")
    # Name in health, metrics and error bodies; "" means "<role>-<pid>".
    worker_id: str = setting("", help="default: <role>-<pid>")
    # Written atomically as {"url": ..., "pid": ...} once the HTTP server listens.
    ready_file: Path | None = setting(None, type=Path, help='write {"url","pid"} here')
    # Seconds between lease-expiry sweeps.
    reap_interval_s: float = 0.5
    engine: EngineConfig = field(default_factory=EngineConfig)
    # Certificates for its HTTP, its calls to other workers and the KV TCP path (`auth/tls.py`).
    tls: TLSConfig = field(default_factory=TLSConfig)
    # Deadline of each KV chunk send and reply: how fast a stalled link is noticed.
    transfer_chunk_timeout_s: float = setting(
        2.0, help="deadline of each KV chunk send and reply (a stalled link is noticed this fast)"
    )
    # Fault-injection rules (`pdserve.faults` syntax), for tests only; () injects nothing.
    faults: tuple[str, ...] = repeated(
        "fault", metavar="SPEC", help="tests only: inject SITE:ACTION[:key=value,...] (repeatable)"
    )
    # Seed of the fault plan's draws.
    fault_seed: int = setting(0, help="seed of the fault plan's draws")
    # Serve GET/POST/DELETE /admin/faults (replace the plan at run time); off: no such routes.
    enable_fault_admin: bool = setting(
        False, action="store_true", help="tests only: serve /admin/faults"
    )
    # Where to register for routers to find ("etcd://HOST:PORT[/PREFIX]"); None: not at all.
    discovery: str | None = setting(
        None,
        DISCOVERY,
        group="membership (several machines)",
        help="register in etcd under a lease, for routers started with the same --discovery",
    )
    # The host others reach this worker at, registered in its URL; None: `host`. Needed when
    # `host` is a wildcard (0.0.0.0) or a name only this machine resolves.
    advertise_host: str | None = setting(
        None,
        type=str,
        group="membership (several machines)",
        help="host others reach this worker at (default: --host)",
    )
    # Seconds the registration outlives the last keep-alive: a worker that dies leaves the
    # routers' pools within this. Whole seconds (etcd leases are).
    membership_ttl_s: int = setting(
        10,
        group="membership (several machines)",
        help="lease TTL: a dead worker leaves the routers' pools within this",
    )
    # Requests whose timeline events are kept for GET /debug/requests/{id} (oldest evicted).
    timeline_ring: int = setting(
        1000, help="recent requests whose timeline events /debug/requests/{id} keeps"
    )
    insecure_no_auth: bool = setting(
        False,
        action="store_true",
        group="security and admission",
        help="serve without a cluster secret (anyone who reaches the ports may call them)",
    )
    # Check received KV by value before the first decode token (the canary), and send the
    # prefill side's digest with every transfer.
    kv_canary: bool = setting(
        True,
        group="KV transfer",
        help="check received KV by value before the first token (and send the digest)",
    )
    # Requests admitted into the engine beyond the `max_num_seqs` it runs at once; past it
    # /generate and /prefill answer 503 Overloaded with Retry-After instead of queueing
    # without bound.
    max_waiting: int = setting(
        256,
        group="security and admission",
        help="requests waiting in the engine before new ones get 503 + Retry-After",
    )
    # SIGTERM or POST /admin/drain: how long the worker finishes what it holds (taking nothing
    # new) before it stops; what is left then is cut as by a crash, and the router recovers it.
    drain_timeout_s: float = setting(
        30.0,
        group="security and admission",
        help="on SIGTERM or /admin/drain, finish held work for up to this long (0: stop at once)",
    )
    # KV data per frame (bytes); a larger block travels as several frames.
    kv_frame_bytes: int = setting(
        4 << 20,
        group="KV transfer",
        help="KV data per frame; a larger block travels as several frames",
    )
    # Which KV transports to serve and use: "auto" (NIXL when installed, shared memory on one
    # host, TCP) or one of them explicitly (an error at start if it cannot be used).
    kv_transport: str = setting(
        "auto",
        choices=KV_TRANSPORTS,
        group="KV transfer",
        help="auto: NIXL when installed, shared memory on one host, else TCP (fallbacks are"
        " logged and counted); an explicit one is required of both sides",
    )
    # KV receiver: a connection must say Hello within this; at most this many at once.
    kv_handshake_timeout_s: float = setting(
        5.0, group="KV transfer", help="a KV connection must say Hello within this"
    )
    kv_max_connections: int = setting(64, group="KV transfer", help="KV connections served at once")
    # Host memory (MiB) this decode worker lends as a checkpoint holder to other decode
    # workers' requests (`pdserve/checkpoint/`); 0: it holds none.
    checkpoint_capacity_mb: int = setting(
        256,
        group="KV transfer",
        help="host memory lent to other decode workers' checkpoints (decode roles; 0: none)",
    )
    # Each checkpoint put carries the value digest of its last position (a one-token forward
    # per put on the decode worker), and a resume here uses only checkpoints that can be
    # checked by value. Off: a resume checks by value only where a digest exists.
    checkpoint_canary: bool = setting(
        False,
        group="KV transfer",
        help="send a value digest with every checkpoint put (one extra one-token forward per"
        " put) and resume only from checkpoints checked by value",
    )
    # With `kv_transport` auto, checkpoint puts of at most this many KiB go over TCP: a put
    # of a few blocks costs 1.5-3x the CPU over shm or NIXL (their slot and agent bookkeeping
    # per message), and it competes with decode steps for the same cores. 0: puts use the
    # handoffs' transport. An explicit --kv-transport always wins.
    checkpoint_small_put_kib: int = setting(
        2048,
        group="KV transfer",
        help="with --kv-transport auto, checkpoint puts of at most this many KiB go over TCP"
        " (cheaper per message than shm or NIXL); 0: the handoffs' transport",
    )
    # Puts that go over TCP ride one long-lived replication link per holder (a handshake
    # per connection, then one frame and one reply per put) instead of an HTTP reservation
    # and a transfer session each (`worker/checkpoint/link.py`). Off: a session per put.
    checkpoint_links: bool = setting(
        True,
        group="KV transfer",
        help="send checkpoint puts that go over TCP on one long-lived link per holder (one"
        " frame and one reply per put); --no-checkpoint-links: an HTTP call and a transfer"
        " session per put",
    )
    # The cluster credential every control call and KV connection must prove; None only with
    # `insecure_no_auth` (a loud, explicit opt-out for experiments on one machine).
    cluster_secret: ClusterSecret | None = setting(
        None,
        SECRET_FILE,
        group="security and admission",
        help="the cluster secret (else $PDSERVE_CLUSTER_SECRET); every control call and KV"
        " connection must prove it",
    )

    def __post_init__(self) -> None:
        if self.timeline_ring < 1:
            raise ConfigError(f"timeline-ring: must be >= 1, got {self.timeline_ring}")
        if self.role not in ROLES:
            raise ConfigError(f"role: {self.role!r} is not one of {', '.join(ROLES)}")
        for name in ("port", "kv_port"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= 65535:
                raise ConfigError(f"{name}: must be an integer in 0..65535, got {value!r}")
        if not 0 <= self.drain_timeout_s <= 24 * 3600:
            raise ConfigError(f"drain-timeout-s: must be in [0, 86400], got {self.drain_timeout_s}")
        if not self.reap_interval_s > 0:
            raise ConfigError(f"reap_interval_s: must be > 0, got {self.reap_interval_s!r}")
        if not 0 < self.transfer_chunk_timeout_s < float("inf"):
            raise ConfigError(
                f"transfer-chunk-timeout-s: must be a finite number > 0,"
                f" got {self.transfer_chunk_timeout_s!r}"
            )
        parse_rules(self.faults)  # a bad rule fails at start, named
        if self.discovery is not None:
            self._check_discovery()
        if not isinstance(self.checkpoint_capacity_mb, int) or self.checkpoint_capacity_mb < 0:
            raise ConfigError(
                f"checkpoint-capacity-mb: must be a whole number >= 0,"
                f" got {self.checkpoint_capacity_mb!r}"
            )
        if not isinstance(self.checkpoint_small_put_kib, int) or not (
            0 <= self.checkpoint_small_put_kib <= 1 << 20
        ):
            raise ConfigError(
                f"checkpoint-small-put-kib: must be a whole number in 0..{1 << 20},"
                f" got {self.checkpoint_small_put_kib!r}"
            )
        if self.max_waiting < 1:
            raise ConfigError(f"max-waiting: must be >= 1, got {self.max_waiting}")
        if not 4096 <= self.kv_frame_bytes <= 64 << 20:
            raise ConfigError(
                f"kv-frame-bytes: must be in 4096..{64 << 20}, got {self.kv_frame_bytes}"
            )
        if self.kv_transport not in KV_TRANSPORTS:
            raise ConfigError(
                f"kv-transport: {self.kv_transport!r} is not one of {', '.join(KV_TRANSPORTS)}"
            )
        if not 0 < self.kv_handshake_timeout_s < float("inf") or self.kv_max_connections < 1:
            raise ConfigError(
                f"kv-handshake-timeout-s must be > 0 and kv-max-connections >= 1, got"
                f" {self.kv_handshake_timeout_s!r} and {self.kv_max_connections!r}"
            )
        require_secret(
            self.cluster_secret,
            self.insecure_no_auth,
            "; `pdserve up` makes one; --insecure-no-auth serves without one",
        )

    def _check_discovery(self) -> None:
        parse_discovery(self.discovery or "")
        if self.worker_id:  # "" becomes "<role>-<pid>", which is a valid key segment
            check_worker_id(self.worker_id)
        if not isinstance(self.membership_ttl_s, int) or self.membership_ttl_s < 1:
            raise ConfigError(
                f"membership-ttl-s: must be a whole number of seconds >= 1,"
                f" got {self.membership_ttl_s!r}"
            )
        if self.advertise_host is None and self.host in _WILDCARD_HOSTS:
            raise ConfigError(
                f"advertise-host: needed with --host {self.host}: others cannot reach a"
                " wildcard address"
            )

    @property
    def advertised_host(self) -> str:
        """The host in the URL and KV address this worker registers."""
        return self.advertise_host or self.host

    @property
    def serves_decode(self) -> bool:
        """Whether this worker receives KV and decodes (/reserve, /decode)."""
        return self.role in ("decode", "both")

    @property
    def serves_prefill(self) -> bool:
        """Whether this worker prefills and sends KV (/prefill)."""
        return self.role in ("prefill", "both")
