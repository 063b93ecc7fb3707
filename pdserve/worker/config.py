"""The worker's typed configuration, built once by `main` from its flags.

A `WorkerConfig` is frozen and validated at construction (a bad value fails at start, naming
the field). The worker passes `engine` to the engine thread and keeps the rest for itself: the
engine never sees ports, roles or lease settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pdserve.config import EngineConfig
from pdserve.errors import ConfigError

ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One worker process: its role, its endpoints and its engine."""

    # "prefill" serves /prefill, "decode" serves /reserve and /decode, "both" serves all.
    role: str = "both"
    host: str = "127.0.0.1"
    # HTTP control port; 0 picks a free one (reported through `ready_file`).
    port: int = 0
    # KV transfer (TCP) port of a decode/both worker; 0 picks a free one.
    kv_port: int = 0
    # Name in health, metrics and error bodies; "" means "<role>-<pid>".
    worker_id: str = ""
    # Written atomically as {"url": ..., "pid": ...} once the HTTP server listens.
    ready_file: Path | None = None
    # Seconds between lease-expiry sweeps.
    reap_interval_s: float = 0.5
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role: {self.role!r} is not one of {', '.join(ROLES)}")
        for name in ("port", "kv_port"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= 65535:
                raise ConfigError(f"{name}: must be an integer in 0..65535, got {value!r}")
        if not self.reap_interval_s > 0:
            raise ConfigError(f"reap_interval_s: must be > 0, got {self.reap_interval_s!r}")

    @property
    def serves_decode(self) -> bool:
        """Whether this worker receives KV and decodes (/reserve, /decode)."""
        return self.role in ("decode", "both")

    @property
    def serves_prefill(self) -> bool:
        """Whether this worker prefills and sends KV (/prefill)."""
        return self.role in ("prefill", "both")
