"""`pdserve status`: the router, its mode and every worker, read live from their /health.

The router's /health lists its workers; each worker's own /health adds pid, fingerprint,
blocks and leases. A worker that does not answer is shown as down with the error, not
skipped. Output is a table, or JSON with `--json`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.error import URLError
from urllib.request import urlopen

from pdserve.errors import PdserveError
from pdserve.launcher import default_state_file
from pdserve.worker.protocol import WorkerHealth


class StatusError(PdserveError):
    """The router could not be found or did not answer."""


@dataclass(frozen=True, slots=True)
class WorkerRow:
    """One worker as `status` shows it."""

    url: str
    up: bool
    role: str | None = None
    pid: int | None = None
    worker_id: str | None = None
    fingerprint: str | None = None
    num_blocks: int | None = None
    num_free_blocks: int | None = None
    num_pinned_blocks: int | None = None
    num_running: int | None = None
    num_waiting: int | None = None
    transfer_address: str | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    """The router and its workers."""

    router_url: str
    router_pid: int | None
    status: str
    mode: str
    model: str
    workers: tuple[WorkerRow, ...]


def _get_json(url: str, timeout_s: float) -> dict[str, object]:
    with urlopen(url, timeout=timeout_s) as resp:
        data = json.loads(resp.read())
    if not isinstance(data, dict):
        raise StatusError(f"{url}: answer is not a JSON object")
    return data


def find_router_url(url: str | None, state_file: Path | None = None) -> str:
    """The router URL from the flag, else from the file `pdserve up` wrote."""
    if url:
        return url.rstrip("/")
    path = state_file or default_state_file()
    try:
        return str(json.loads(path.read_text())["router_url"])
    except (OSError, ValueError, KeyError):
        raise StatusError(f"no running `pdserve up` found ({path}); pass --url") from None


def collect_status(router_url: str, timeout_s: float = 3.0) -> ClusterStatus:
    """Query the router and each of its workers."""
    try:
        router = _get_json(f"{router_url}/health", timeout_s)
    except (URLError, OSError, ValueError) as exc:
        raise StatusError(f"router {router_url} did not answer /health: {exc}") from None
    entries = router.get("workers")
    if not isinstance(entries, list):
        raise StatusError(f"router {router_url}: /health has no worker list")
    rows: list[WorkerRow] = []
    for entry in entries:
        url = str(entry["url"])
        try:
            h = WorkerHealth.model_validate(_get_json(f"{url}/health", timeout_s))
        except Exception as exc:  # any failure means: show it as down, with why
            rows.append(WorkerRow(url, False, error=f"{type(exc).__name__}: {exc}"))
            continue
        rows.append(
            WorkerRow(
                url,
                True,
                h.role,
                h.pid,
                h.worker_id,
                h.fingerprint_digest,
                h.num_blocks,
                h.num_free_blocks,
                h.num_pinned_blocks,
                h.num_running,
                h.num_waiting,
                h.transfer_address,
            )
        )
    pid = router.get("pid")
    return ClusterStatus(
        router_url,
        pid if isinstance(pid, int) else None,
        str(router.get("status")),
        str(router.get("mode")),
        str(router.get("model")),
        tuple(rows),
    )


def render_json(status: ClusterStatus) -> str:
    return json.dumps(asdict(status), indent=2)


def render_table(status: ClusterStatus) -> str:
    """A fixed-width table; fingerprints shortened to 12 hex digits (groups stay visible)."""
    lines = [
        f"router {status.router_url}  pid {status.router_pid}  status {status.status}  "
        f"mode {status.mode}  "
        f"model {status.model}",
        f"{'worker':<12}{'role':<9}{'pid':>8}  {'url':<24}{'fingerprint':<14}"
        f"{'free/total':>12}{'pinned':>8}{'run':>5}{'wait':>5}",
    ]
    for w in status.workers:
        if not w.up:
            lines.append(f"{'?':<12}{'down':<9}{'':>8}  {w.url:<24}{w.error or ''}")
            continue
        blocks = f"{w.num_free_blocks}/{w.num_blocks}"
        lines.append(
            f"{w.worker_id or '':<12}{w.role or '':<9}{w.pid or 0:>8}  {w.url:<24}"
            f"{(w.fingerprint or '')[:12]:<14}{blocks:>12}{w.num_pinned_blocks:>8}"
            f"{w.num_running:>5}{w.num_waiting:>5}"
        )
    return "\n".join(lines)
