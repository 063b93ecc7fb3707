"""Router-assigned roles: `both` workers serving as prefill workers without a restart.

A `both` worker already serves /prefill, /reserve, /decode and /generate, so splitting a pool
needs no worker change at all: the router only stops treating some of them as decode-capable.
`RoleOverlay` holds the set of `both` workers acting as prefill workers; `AssignedPool` is the
worker pool whose `snapshot()` marks them (`WorkerView.assigned_role = "prefill"`), so every
placement decision (`policy.py`, `affinity.py`, /health, /ready) sees the same roles:

- split: the assigned workers are prefill candidates only; the others stay `both`, so they are
  the decode candidates, and a request that began colocated and must retry before its first
  token still finds a `both` worker;
- colocated: the set is empty and every worker is `both` again.

In-flight requests are untouched: a flow holds the worker URLs it chose, and an assignment only
changes what later placements see. A worker leaving the pool drops out of the set.

`choose_prefill` is the pure choice of which workers take the prefill role: those already
assigned first (a resize moves as few workers as it can), then the least loaded, then list order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from pdserve.router.placement.policy import WorkerView, load_key
from pdserve.router.workers.pool import WorkerPool


class RoleOverlay:
    """The `both` workers the router uses as prefill workers."""

    def __init__(self) -> None:
        self._prefill: frozenset[str] = frozenset()

    @property
    def prefill_urls(self) -> frozenset[str]:
        """Workers assigned the prefill role (empty: colocated, or the workers' own roles)."""
        return self._prefill

    def assign(self, prefill_urls: Iterable[str]) -> None:
        """Make exactly `prefill_urls` prefill workers (an empty set clears the overlay)."""
        self._prefill = frozenset(prefill_urls)

    def apply(self, views: Sequence[WorkerView]) -> list[WorkerView]:
        """`views` with the assignment marked on `both` workers (others keep their role)."""
        if not self._prefill:
            return list(views)
        return [
            dataclasses.replace(v, assigned_role="prefill")
            if v.url in self._prefill and v.health is not None and v.health.role == "both"
            else v
            for v in views
        ]


class AssignedPool(WorkerPool):
    """A `WorkerPool` whose snapshots show the overlay's roles."""

    def __init__(self, *args: Any, overlay: RoleOverlay, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.overlay = overlay

    def snapshot(self) -> list[WorkerView]:
        """The pool's views with router-assigned roles marked."""
        return self.overlay.apply(super().snapshot())


def assignable(views: Sequence[WorkerView], digest: str | None) -> list[WorkerView]:
    """Healthy `both` workers (their own role) of the compatible group, in list order."""
    return [
        v
        for v in sorted(views, key=lambda v: v.index)
        if v.healthy
        and v.health is not None
        and v.health.role == "both"
        and v.health.fingerprint_digest == digest
    ]


def choose_prefill(
    workers: Sequence[WorkerView], current: frozenset[str], num_prefill: int
) -> frozenset[str]:
    """`num_prefill` of `workers` for the prefill role (see the module docstring)."""
    ranked = sorted(
        (w for w in workers if w.health is not None),
        key=lambda w: (w.url not in current, *load_key(w)),
    )
    return frozenset(w.url for w in ranked[: max(0, num_prefill)])
