"""What the router's GET /health answers: its models, one per part of the answer."""

from __future__ import annotations

from pydantic import BaseModel

from pdserve.router.config import Mode
from pdserve.router.mode.control import AutoView


class WorkerSummary(BaseModel):
    """One worker in GET /health."""

    url: str
    healthy: bool
    worker_id: str | None
    # The worker process's life it answered as last (a restart at the same URL changes it).
    instance_id: str | None = None
    # Times the router saw this URL answer as a new instance (restarts at the same address).
    num_restarts: int = 0
    role: str | None
    # The role the router gave this `both` worker (split by auto mode or an operator), if any.
    assigned_role: str | None = None
    fingerprint_digest: str | None
    num_free_blocks: int | None
    num_running: int | None
    num_inflight: int
    last_error: str | None


class FieldDiffView(BaseModel):
    """A fingerprint field on which a group differs from the compatible one."""

    field: str
    value: str | int | float | None
    compatible_value: str | int | float | None


class FingerprintGroupView(BaseModel):
    """Healthy workers with one fingerprint; only the compatible group is ever paired."""

    digest: str
    compatible: bool
    workers: list[str]
    roles: list[str]
    differs: list[FieldDiffView]


class KVPairView(BaseModel):
    """One prefill/decode pair's attested KV path in GET /health."""

    prefill: str
    decode: str
    verdict: str
    transport: str
    gbps: float
    downgraded_from: str | None
    detail: str


class BreakerView(BaseModel):
    """The KV-path circuit breaker in GET /health."""

    enabled: bool
    state: str
    failure_rate: float
    last_transition: str | None


class RouterHealth(BaseModel):
    """GET /health."""

    # "ok" when requests of the effective mode can be served as configured, else "degraded"
    # with the reasons in `problems` (e.g. pools whose fingerprints cannot pair).
    status: str
    problems: list[str]
    pid: int
    # The mode new requests begin in (set by the operator or the automatic mode), and the one
    # they get now (colocated while the breaker is open); `mode_setting` is "auto" while the
    # automatic mode decides.
    mode: Mode
    effective_mode: Mode
    mode_setting: str
    breaker: BreakerView
    model: str
    compatible_digest: str | None
    fingerprint_groups: list[FingerprintGroupView]
    workers: list[WorkerSummary]
    auto: AutoView
    # Membership records ignored: unreadable, or not signed with the cluster's key.
    membership_refused: int = 0
    # The last probe of every current prefill/decode pair (`router/workers/pair_probes.py`).
    kv_pairs: list[KVPairView] = []
