"""Revisions: several builds of one served model in one pool, for rollouts without a second
cluster. Pure.

A revision is a fingerprint digest (weights, tokenizer, dtype, ... : `model/fingerprint.py`);
KV never crosses revisions, so a request's prefill and decode are always paired within one.

- **Order.** The router ranks revisions by when it first saw each (`RevisionBook.note`): the
  one seen last is the newest (of those first seen together, the one with most workers). A
  rollout starts workers of the new build; from their first health answer their revision is
  the newest.
- **Ready.** A revision is ready when its healthy, non-draining workers can run a request in
  the mode at hand: split, a decode-capable (decode or both) and a prefill-capable (prefill or
  both) worker that is not that one; colocated, one worker of role both or decode.
- **Choice.** A request not yet pinned goes to the newest ready revision, or with a canary
  weight w < 1 a share w of requests (by their arrival number) goes there and the rest to the
  next newest ready one. No revision ready: the pool's compatible group (the majority), as
  without revisions.
- **Pinning.** Once a request's first token has left for the client it is pinned to the
  revision that computed it (`RouteQuery.revision`): every later placement (migration,
  re-prefill) looks at that revision's workers only, so no request is ever continued by
  another build. A request with nothing sent yet is placed afresh each time, so a queued
  request follows the rollout instead of waiting for a revision that drained away.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import xxhash

from pdserve.router.placement.policy import WorkerView


class RevisionBook:
    """Which revisions the router has seen, in the order it first saw them."""

    def __init__(self) -> None:
        self._first_seen: dict[str, int] = {}

    def note(self, views: Sequence[WorkerView]) -> None:
        """Record the revisions of the workers that answer now. Revisions first seen together
        (the router's first look at a pool) rank by their number of workers, the majority as
        the newest: a pool that starts mixed serves its majority, as without revisions."""
        counts = Counter(
            v.health.fingerprint_digest for v in views if v.healthy and v.health is not None
        )
        for digest, _ in sorted(counts.items(), key=lambda kv: (kv[1], kv[0])):
            self._first_seen.setdefault(digest, len(self._first_seen))

    def newest_first(self, digests: Sequence[str]) -> list[str]:
        """`digests` ordered newest first (one never seen sorts last)."""
        return sorted(digests, key=lambda d: -self._first_seen.get(d, -1))


def _serving(views: Sequence[WorkerView], digest: str, roles: tuple[str, ...]) -> list[str]:
    return [
        v.url
        for v in views
        if v.healthy
        and v.health is not None
        and not v.health.draining
        and v.health.fingerprint_digest == digest
        and v.role in roles
    ]


def ready(views: Sequence[WorkerView], digest: str, colocated: bool) -> bool:
    """Whether revision `digest` can run a request now (see the module docstring)."""
    if colocated:
        return bool(_serving(views, digest, ("both", "decode")))
    decode = _serving(views, digest, ("decode", "both"))
    prefill = _serving(views, digest, ("prefill", "both"))
    return any(p != d for d in decode for p in prefill)


def choose(
    views: Sequence[WorkerView],
    book: RevisionBook,
    ticket: int,
    colocated: bool,
    canary_weight: float = 1.0,
) -> str | None:
    """The revision for a request not yet pinned (None: no revision is ready)."""
    digests = {v.health.fingerprint_digest for v in views if v.health is not None}
    candidates = [d for d in book.newest_first(sorted(digests)) if ready(views, d, colocated)]
    if not candidates:
        return None
    if canary_weight >= 1.0 or len(candidates) == 1:
        return candidates[0]
    # A stable share by arrival number: the same tickets always go to the canary.
    draw = xxhash.xxh3_64_intdigest(ticket.to_bytes(8, "little")) / 2**64
    return candidates[0] if draw < canary_weight else candidates[1]


def restrict(views: Sequence[WorkerView], digest: str | None) -> list[WorkerView]:
    """The workers of revision `digest` (every worker when None)."""
    if digest is None:
        return list(views)
    return [v for v in views if v.health is not None and v.health.fingerprint_digest == digest]
