"""`pdserve status`: the router, its mode and breaker, and every worker, read live from /health.

The router's /health gives the mode (configured and effective), the breaker and its view of
each worker (healthy, in-flight calls); each worker's own /health adds role, pid, device,
fingerprint, blocks, requests and leases. When the cluster is a `pdserve up`, its state file
adds every process it supervises (routers, workers, etcd) with its state and restarts. Workers
are grouped by fingerprint digest: only workers of one group can exchange KV (DESIGN.md
invariant 3), so a worker outside the router's compatible group is marked. A worker that does
not answer is shown as down with the error, not skipped. Output is a table, or JSON with
`--json`. Collecting does the I/O; grouping and rendering are pure.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any
from urllib.error import URLError
from urllib.request import urlopen

from pdserve.cli.command import run
from pdserve.cli.dial import add_tls_flags, dial_with_tls
from pdserve.errors import PdserveError
from pdserve.protocol.worker_api import WorkerHealth
from pdserve.supervise.launcher import default_state_file
from pdserve.supervise.supervisor import ChildStatus


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
    num_active_leases: int | None = None
    # The router's view: calls in flight to this worker, and whether it may be chosen.
    num_inflight: int | None = None
    routable: bool | None = None
    # Letter of the worker's fingerprint group ("A" is the largest), None when down.
    group: str | None = None
    # The role the router gave this `both` worker (auto mode or /admin/mode), if any.
    assigned_role: str | None = None
    # "cpu" or "cuda", from the worker's fingerprint (which names it only when not "cpu").
    device: str | None = None
    # This life of the worker (new at each restart), and the restarts the router saw.
    instance_id: str | None = None
    num_restarts: int | None = None
    # Finishing what it holds before it stops (SIGTERM or /admin/drain); chosen for nothing new.
    draining: bool = False


@dataclass(frozen=True, slots=True)
class FingerprintGroup:
    """Workers whose KV is interchangeable (same fingerprint digest)."""

    name: str
    digest: str
    worker_ids: tuple[str, ...]
    # True for the group the router pairs prefill and decode workers in.
    compatible: bool
    # Fingerprint fields on which this group differs from the compatible one, as the router
    # reports them ("field: value != compatible_value"); empty for the compatible group.
    differs: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PairRow:
    """One prefill/decode pair's KV path as the router's probe attested it."""

    prefill: str
    decode: str
    transport: str
    gbps: float
    # "ok", "slow" (steered around) or "failed".
    verdict: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    """The router and its workers."""

    router_url: str
    router_pid: int | None
    status: str
    mode: str
    model: str
    workers: tuple[WorkerRow, ...]
    effective_mode: str | None = None
    breaker_state: str | None = None
    breaker_failure_rate: float | None = None
    compatible_digest: str | None = None
    groups: tuple[FingerprintGroup, ...] = ()
    # Why the router is degraded (e.g. pools whose fingerprints cannot pair), as it says.
    problems: tuple[str, ...] = ()
    # "auto" while the router's automatic mode decides; else the mode (None: older router).
    mode_setting: str | None = None
    # The processes `pdserve up` supervises (empty for a cluster it did not start).
    processes: tuple[ChildStatus, ...] = ()
    # Every current prefill/decode pair's probed KV rate (empty: none probed, or probes off).
    pairs: tuple[PairRow, ...] = ()


def read_processes(router_url: str, state_file: Path | None = None) -> tuple[ChildStatus, ...]:
    """The supervised processes of the `pdserve up` serving `router_url`, if it wrote them."""
    path = state_file or default_state_file()
    try:
        state = json.loads(path.read_text())
        if router_url.rstrip("/") not in [u.rstrip("/") for u in state.get("router_urls", [])]:
            return ()
        return tuple(
            ChildStatus(
                str(c["name"]),
                str(c.get("kind", "")),
                str(c.get("state", "")),
                c.get("pid"),
                c.get("url"),
                int(c.get("num_restarts", 0)),
                c.get("last_exit"),
                c.get("reason"),
                tuple(c.get("pids", ())),
            )
            for c in state.get("children", [])
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ()


def _get_json(url: str, timeout_s: float) -> dict[str, Any]:
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


def fingerprint_groups(
    rows: tuple[WorkerRow, ...],
    compatible_digest: str | None,
    differs: dict[str, tuple[str, ...]] | None = None,
) -> tuple[FingerprintGroup, ...]:
    """Workers that answered, grouped by digest: largest group first (ties: digest order);
    `differs` adds the router's differing fields per digest."""
    members: dict[str, list[str]] = {}
    for row in rows:
        if row.up and row.fingerprint is not None:
            members.setdefault(row.fingerprint, []).append(row.worker_id or row.url)
    ordered = sorted(members.items(), key=lambda item: (-len(item[1]), item[0]))
    return tuple(
        FingerprintGroup(
            chr(ord("A") + i),
            digest,
            tuple(ids),
            digest == compatible_digest,
            (differs or {}).get(digest, ()),
        )
        for i, (digest, ids) in enumerate(ordered)
    )


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
        seen = {
            "num_inflight": entry.get("num_inflight"),
            "routable": entry.get("healthy"),
            "assigned_role": _str_or_none(entry.get("assigned_role")),
            "num_restarts": entry.get("num_restarts"),
        }
        try:
            h = WorkerHealth.model_validate(_get_json(f"{url}/health", timeout_s))
        except Exception as exc:  # any failure means: show it as down, with why
            rows.append(WorkerRow(url, False, error=f"{type(exc).__name__}: {exc}", **seen))
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
                num_active_leases=h.num_active_leases,
                device=str(h.fingerprint.get("device", "cpu")),
                instance_id=h.instance_id or None,
                draining=h.draining,
                **seen,
            )
        )
    compatible = router.get("compatible_digest")
    compatible = compatible if isinstance(compatible, str) else None
    groups = fingerprint_groups(tuple(rows), compatible, _router_differs(router))
    letter = {g.digest: g.name for g in groups}
    rows = [
        WorkerRow(**{**asdict(r), "group": letter.get(r.fingerprint or "")}) if r.up else r
        for r in rows
    ]
    breaker = router.get("breaker")
    breaker = breaker if isinstance(breaker, dict) else {}
    pid = router.get("pid")
    rate = breaker.get("failure_rate")
    return ClusterStatus(
        router_url,
        pid if isinstance(pid, int) else None,
        str(router.get("status")),
        str(router.get("mode")),
        str(router.get("model")),
        tuple(rows),
        effective_mode=_str_or_none(router.get("effective_mode")),
        breaker_state=_str_or_none(breaker.get("state")),
        breaker_failure_rate=float(rate) if isinstance(rate, int | float) else None,
        compatible_digest=compatible,
        groups=groups,
        problems=tuple(str(p) for p in router.get("problems") or ()),
        mode_setting=_str_or_none(router.get("mode_setting")),
        pairs=_pairs(router),
    )


def _pairs(router: dict[str, Any]) -> tuple[PairRow, ...]:
    """The router's `kv_pairs`, skipping entries it could not have written."""
    rows = []
    for p in router.get("kv_pairs") or ():
        try:
            rows.append(
                PairRow(
                    str(p["prefill"]),
                    str(p["decode"]),
                    str(p["transport"]),
                    float(p["gbps"]),
                    str(p["verdict"]),
                    str(p.get("detail") or ""),
                )
            )
        except (KeyError, TypeError, ValueError):
            continue
    return tuple(rows)


def _router_differs(router: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """Differing fingerprint fields per digest from the router's `fingerprint_groups`."""
    found: dict[str, tuple[str, ...]] = {}
    for group in router.get("fingerprint_groups") or ():
        if isinstance(group, dict) and isinstance(group.get("digest"), str):
            found[group["digest"]] = tuple(
                f"{d.get('field')}: {d.get('value')} != {d.get('compatible_value')}"
                for d in group.get("differs") or ()
                if isinstance(d, dict)
            )
    return found


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def render_json(status: ClusterStatus) -> str:
    return json.dumps(asdict(status), indent=2)


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def render_table(status: ClusterStatus) -> str:
    """A fixed-width table; fingerprints shortened to 12 hex digits, grouped by letter."""
    rate = status.breaker_failure_rate
    mode = status.mode
    if status.mode_setting is not None and status.mode_setting != status.mode:
        mode = f"{status.mode_setting} ({status.mode} now)"
    lines = [
        f"router {status.router_url}  pid {status.router_pid}  status {status.status}  "
        f"mode {mode}  effective {_cell(status.effective_mode)}  "
        f"breaker {_cell(status.breaker_state)}"
        + ("" if rate is None else f" ({rate:.0%} failed)")
        + f"  model {status.model}",
        f"{'worker':<12}{'role':<9}{'pid':>8}  {'url':<24}{'grp':<4}{'dev':<5}{'fingerprint':<14}"
        f"{'free/total':>12}{'pinned':>8}{'run':>5}{'wait':>5}{'lease':>6}{'infl':>5}"
        f"  {'instance':<10}{'rst':>3}",
    ]
    for w in status.workers:
        if not w.up:
            lines.append(f"{'?':<12}{'down':<9}{'':>8}  {w.url:<24}{w.error or ''}")
            continue
        blocks = f"{w.num_free_blocks}/{w.num_blocks}"
        role = w.role or ""
        if w.assigned_role is not None:
            role = f"{w.assigned_role}*"  # a `both` worker the router uses in this role
        if w.draining:
            role += "~"  # finishes what it holds, takes nothing new
        elif w.routable is False:
            role += "!"  # answers us, but the router will not choose it now
        lines.append(
            f"{w.worker_id or '':<12}{role:<9}{w.pid or 0:>8}  {w.url:<24}{_cell(w.group):<4}"
            f"{_cell(w.device):<5}"
            f"{(w.fingerprint or '')[:12]:<14}{blocks:>12}{w.num_pinned_blocks:>8}"
            f"{w.num_running:>5}{w.num_waiting:>5}{_cell(w.num_active_leases):>6}"
            f"{_cell(w.num_inflight):>5}  {(w.instance_id or '-')[:8]:<10}{_cell(w.num_restarts):>3}"
        )
    for g in status.groups:
        mark = "compatible" if g.compatible else "not paired by the router"
        lines.append(
            f"group {g.name} {g.digest[:12]}: {len(g.worker_ids)} worker(s)"
            f" {', '.join(g.worker_ids)} ({mark})"
            + (f"; differs: {'; '.join(g.differs)}" if g.differs else "")
        )
    if status.pairs:
        names = {w.url: w.worker_id or w.url for w in status.workers}
        lines.append(f"{'kv pair (prefill -> decode)':<36}{'transport':<10}{'GB/s':>8}  verdict")
        for pr in status.pairs:
            pair = f"{names.get(pr.prefill, pr.prefill)} -> {names.get(pr.decode, pr.decode)}"
            lines.append(
                f"{pair:<36}{pr.transport or '-':<10}{pr.gbps:>8.2f}  {pr.verdict}"
                + (f" ({pr.detail})" if pr.detail else "")
            )
    if any(w.assigned_role is not None for w in status.workers):
        lines.append("* role assigned by the router to a `both` worker (auto mode or /admin/mode)")
    if any(w.draining for w in status.workers):
        lines.append("~ draining: finishes what it holds, takes nothing new, then stops")
    lines += [f"problem: {p}" for p in status.problems]
    if status.processes:
        lines.append(
            f"{'process':<12}{'kind':<8}{'state':<10}{'pid':>8}{'restarts':>9}  last exit / why"
        )
        for p in status.processes:
            why = p.reason or p.last_exit or ""
            lines.append(
                f"{p.name:<12}{p.kind:<8}{p.state:<10}{_cell(p.pid):>8}{p.num_restarts:>9}  {why}"
            )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    st = argparse.ArgumentParser(prog="pdserve status", description=__doc__.splitlines()[0])
    st.add_argument("--url", default=None, help="router URL (default: the running `pdserve up`)")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_tls_flags(st)
    return st


def _status(args: argparse.Namespace) -> int:
    dial_with_tls(args)
    url = find_router_url(args.url)
    status = replace(collect_status(url), processes=read_processes(url))
    print(render_json(status) if args.json else render_table(status))
    return 0


def main(argv: Sequence[str]) -> int:
    """Run the command; returns the exit status."""
    return run("status", build_parser(), _status, argv)
