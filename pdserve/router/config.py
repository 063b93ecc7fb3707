"""`RouterConfig`: everything the router process needs, built once from the command line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pdserve.errors import ConfigError

Mode = Literal["disagg", "colocated"]
MODES: tuple[Mode, ...] = ("disagg", "colocated")


def parse_mode(value: str) -> Mode:
    """`value` as a Mode; ConfigError naming it otherwise."""
    for mode in MODES:
        if value == mode:
            return mode
    raise ConfigError(f"mode: {value!r} is not one of {', '.join(MODES)}")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The router's settings; validated at construction."""

    # Worker base URLs, e.g. "http://127.0.0.1:8101".
    workers: tuple[str, ...]
    # Folder with the tokenizer and config.json; its name is the served model name.
    model: Path
    mode: Mode = "disagg"
    host: str = "127.0.0.1"
    # 0 picks a free port (reported through ready_file).
    port: int = 0
    # When set, /v1 and /admin need "Authorization: Bearer <api_key>".
    api_key: str | None = None
    ready_file: Path | None = None
    # Whole request, from received to the last token.
    request_timeout_s: float = 600.0
    health_poll_interval_s: float = 1.0
    # How long a decode reservation (and the prefill KV) waits for its transfer.
    lease_ttl_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.workers:
            raise ConfigError("worker: at least one --worker URL is needed")
        for url in self.workers:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"worker: {url!r} is not an http(s) URL")
        parse_mode(self.mode)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: must be in 0..65535, got {self.port}")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request-timeout-s: must be > 0, got {self.request_timeout_s}")
        if self.health_poll_interval_s <= 0 or self.lease_ttl_s <= 0:
            raise ConfigError("health_poll_interval_s and lease_ttl_s must be > 0")

    @property
    def model_name(self) -> str:
        """The name clients pass as `model` (the folder's name)."""
        return self.model.name
