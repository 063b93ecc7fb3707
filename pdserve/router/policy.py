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
   deterministic, so tests assert the choice.
4. A prefill worker must have the decode worker's digest; role `prefill` is preferred over a
   `both` worker, and the decode worker itself is never its own prefill worker.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pdserve.worker.protocol import WorkerHealth


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


def _load_key(w: WorkerView) -> tuple[int, int, int]:
    assert w.health is not None
    busy = w.health.num_running + w.health.num_waiting + w.num_inflight
    return (busy, -w.health.num_free_blocks, w.index)


def _candidates(
    workers: Sequence[WorkerView], roles: Collection[str], digest: str, exclude: Collection[str]
) -> list[WorkerView]:
    return [
        w
        for w in workers
        if w.healthy
        and w.health is not None
        and w.health.role in roles
        and w.health.fingerprint_digest == digest
        and w.url not in exclude
    ]


def rank_decode(workers: Sequence[WorkerView], exclude: Collection[str] = ()) -> list[WorkerView]:
    """Decode candidates (role decode or both) of the compatible group, best first."""
    digest = compatible_digest(workers)
    if digest is None:
        return []
    return sorted(_candidates(workers, ("decode", "both"), digest, exclude), key=_load_key)


def pick_prefill(
    workers: Sequence[WorkerView], decode: WorkerView, exclude: Collection[str] = ()
) -> WorkerView | None:
    """The prefill worker for `decode`: same digest, role prefill preferred, least loaded."""
    if decode.health is None:
        return None
    digest = decode.health.fingerprint_digest
    skip = {*exclude, decode.url}
    found = _candidates(workers, ("prefill", "both"), digest, skip)
    if not found:
        return None
    return min(found, key=lambda w: (w.health is None or w.health.role != "prefill", _load_key(w)))


def rank_colocated(
    workers: Sequence[WorkerView], exclude: Collection[str] = ()
) -> list[WorkerView]:
    """Workers that can run a whole request (role both) of the compatible group, best first."""
    digest = compatible_digest(workers)
    if digest is None:
        return []
    return sorted(_candidates(workers, ("both",), digest, exclude), key=_load_key)
