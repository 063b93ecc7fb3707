"""Worker selection: which decode (or both) worker, then which prefill worker. Pure.

Inputs are `WorkerView`s, a snapshot the pool takes from its last health polls plus the
router's own in-flight counts (polls are seconds apart; in-flight counts move per request, so
a burst spreads out instead of landing on the worker that looked idlest at the last poll).

Rules, in order:
1. Only workers whose last poll succeeded are candidates.
2. The pool's **compatible group** is the fingerprint digest held by most healthy workers; a
   tie goes to the group of the earliest worker in the configured list. Workers outside it are
   never chosen, so two engines with different fingerprints are never paired (invariant 3).
3. Among candidates of the right role, the least loaded wins: fewest requests (running +
   waiting + router in-flight), then most free KV blocks, then list order. Exact and
   deterministic, so tests assert the choice. (`affinity.py` reorders these same candidates
   by cached prefix, session and load.)
4. A prefill worker must have the decode worker's digest; role `prefill` is preferred over a
   `both` worker, and the decode worker itself is never its own prefill worker.
A worker's role is `WorkerView.role`: the role the router assigned it (`roles.py`), else its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pdserve.protocol.worker_api import WorkerHealth


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the policy sees it."""

    url: str
    # Position in the configured worker list (the final tie-break).
    index: int
    # None until the first successful poll.
    health: WorkerHealth | None
    healthy: bool
    # Requests the router has sent there and not yet seen finish.
    num_inflight: int = 0
    # A role the router gave this `both` worker (`router/mode/roles.py`: "prefill" while the
    # automatic mode or an operator splits the pool); None: its own role.
    assigned_role: str | None = None

    @property
    def role(self) -> str | None:
        """The role selection uses: the assigned one, else the worker's own (None: no poll)."""
        if self.assigned_role is not None:
            return self.assigned_role
        return None if self.health is None else self.health.role


def compatible_digest(workers: Sequence[WorkerView]) -> str | None:
    """The majority fingerprint digest among healthy workers (ties: earliest worker's)."""
    live = [w for w in workers if w.healthy and w.health is not None]
    if not live:
        return None
    counts = Counter(w.health.fingerprint_digest for w in live if w.health is not None)
    best = max(counts.values())
    for w in sorted(live, key=lambda v: v.index):
        assert w.health is not None  # filtered above; narrows the type
        if counts[w.health.fingerprint_digest] == best:
            return w.health.fingerprint_digest
    return None  # unreachable: some live worker holds the best count


def load_key(w: WorkerView) -> tuple[int, int, int]:
    """(requests on it, -free blocks, list index): the least-loaded order of rule 3."""
    assert w.health is not None
    busy = w.health.num_running + w.health.num_waiting + w.num_inflight
    return (busy, -w.health.num_free_blocks, w.index)


def candidates(
    workers: Sequence[WorkerView], roles: Collection[str], digest: str, exclude: Collection[str]
) -> list[WorkerView]:
    """Healthy workers of `roles` with fingerprint `digest`, not in `exclude` (rules 1, 2),
    and not draining (they finish what they hold and take nothing new)."""
    return [
        w
        for w in workers
        if w.healthy
        and w.health is not None
        and not w.health.draining
        and w.role in roles
        and w.health.fingerprint_digest == digest
        and w.url not in exclude
    ]


def rank_decode(workers: Sequence[WorkerView], exclude: Collection[str] = ()) -> list[WorkerView]:
    """Decode candidates (role decode or both) of the compatible group, best first."""
    digest = compatible_digest(workers)
    if digest is None:
        return []
    return sorted(candidates(workers, ("decode", "both"), digest, exclude), key=load_key)


def pick_prefill(
    workers: Sequence[WorkerView], decode: WorkerView, exclude: Collection[str] = ()
) -> WorkerView | None:
    """The prefill worker for `decode`: same digest, role prefill preferred, least loaded."""
    if decode.health is None:
        return None
    digest = decode.health.fingerprint_digest
    skip = {*exclude, decode.url}
    found = candidates(workers, ("prefill", "both"), digest, skip)
    if not found:
        return None
    return min(found, key=lambda w: (w.role != "prefill", load_key(w)))


def rank_colocated(
    workers: Sequence[WorkerView], exclude: Collection[str] = ()
) -> list[WorkerView]:
    """Workers that can run a whole request of the compatible group, best first: role both,
    else (a split pool re-colocated by the breaker or an operator) the decode workers, which
    run whole requests already for local prefills and migrations."""
    digest = compatible_digest(workers)
    if digest is None:
        return []
    found = candidates(workers, ("both",), digest, exclude) or candidates(
        workers, ("decode",), digest, exclude
    )
    return sorted(found, key=load_key)


@dataclass(frozen=True, slots=True)
class FieldDiff:
    """One fingerprint field on which a group differs from the compatible group."""

    field: str
    value: str | int | float | None
    compatible_value: str | int | float | None


@dataclass(frozen=True, slots=True)
class FingerprintGroup:
    """Healthy workers sharing one fingerprint digest, and how it differs from the used one."""

    digest: str
    # The group the router pairs within (`compatible_digest`).
    compatible: bool
    worker_urls: tuple[str, ...]
    # Sorted, distinct.
    roles: tuple[str, ...]
    # Empty for the compatible group; fields in sorted order.
    differs: tuple[FieldDiff, ...]


def fingerprint_groups(workers: Sequence[WorkerView]) -> list[FingerprintGroup]:
    """Healthy workers grouped by digest: the compatible group first, then by first worker."""
    live = sorted((w for w in workers if w.healthy and w.health is not None), key=lambda v: v.index)
    chosen = compatible_digest(live)
    members: dict[str, list[WorkerView]] = {}
    for w in live:
        assert w.health is not None  # filtered above; narrows the type
        members.setdefault(w.health.fingerprint_digest, []).append(w)
    fields_of = {d: g[0].health.fingerprint if g[0].health else {} for d, g in members.items()}
    reference = fields_of.get(chosen, {}) if chosen is not None else {}
    groups = []
    for digest, group in members.items():
        fields = fields_of[digest]
        differs = tuple(
            FieldDiff(name, fields.get(name), reference.get(name))
            for name in sorted({*fields, *reference})
            if digest != chosen and fields.get(name) != reference.get(name)
        )
        roles = tuple(sorted({w.role for w in group if w.role is not None}))
        urls = tuple(w.url for w in group)
        groups.append(FingerprintGroup(digest, digest == chosen, urls, roles, differs))
    return sorted(groups, key=lambda g: not g.compatible)


def pairing_problems(workers: Sequence[WorkerView], mode: str) -> list[str]:
    """Why requests in `mode` cannot be served as configured; empty when they can.

    Disaggregated mode needs a decode-capable and a distinct prefill-capable worker in the
    compatible group; colocated mode a `both` worker. Workers outside the compatible group are
    reported with the fields that keep them from pairing, since they are never used.
    """
    groups = fingerprint_groups(workers)
    problems: list[str] = []
    if not groups:
        return ["no healthy worker"]
    main = groups[0]
    for group in groups[1:]:
        fields = ", ".join(
            f"{d.field} {d.value!r} != {d.compatible_value!r}" for d in group.differs
        )
        problems.append(
            f"{len(group.worker_urls)} worker(s) ({', '.join(group.worker_urls)}) cannot pair"
            f" with the compatible group {main.digest}: {fields or 'digest differs'}"
        )
    in_main = [w for w in workers if w.url in main.worker_urls and w.health is not None]
    if mode == "colocated":
        if not any(w.role == "both" for w in in_main):
            problems.append("colocated: no worker of role both in the compatible group")
        return problems
    decodes = [w for w in in_main if w.role in ("decode", "both")]
    if not decodes:
        problems.append("disagg: no decode worker in the compatible group")
    elif all(pick_prefill(workers, d) is None for d in decodes):
        problems.append(
            "disagg: no prefill worker in the compatible group can pair with a decode worker"
            " (requests fall back to prefill on the decode worker)"
        )
    return problems
