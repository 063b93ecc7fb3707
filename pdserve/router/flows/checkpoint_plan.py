"""Where a decoding request's checkpoints go: the router's half of decode checkpoints. Pure.

The holder is another decode-capable worker of the same compatible group (its host tier
takes KV of this fingerprint), never the decoding worker itself, the least loaded first; a
migrated request keeps its holder when it can, so the new decode worker pulls from it and
takes the held blocks over instead of sending them again. A resume is also told which
workers' prefix caches may hold the request's leading blocks (the KV-event index's holders,
then its prefill worker): the new decode worker pulls from whichever holds the most, so a
dead holder, or one still behind, costs only the blocks nobody has.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from pdserve.protocol.checkpoint_policy import CheckpointPolicy
from pdserve.protocol.worker_api import CheckpointPlan, CheckpointSource
from pdserve.router.config import RecoveryConfig
from pdserve.router.placement.policy import WorkerView, rank_decode


def choose_holder(
    workers: Sequence[WorkerView],
    decode_url: str,
    keep: str | None = None,
    exclude: Collection[str] = (),
) -> str | None:
    """The holder for a request decoding on `decode_url` (None: no other worker)."""
    ranked = [w.url for w in rank_decode(workers, exclude={*exclude, decode_url})]
    if keep is not None and keep in ranked:
        return keep
    return ranked[0] if ranked else None


def plan(recovery: RecoveryConfig, holder: str | None) -> CheckpointPlan | None:
    """The decode body's checkpoint plan (None: checkpoints off or no holder)."""
    if holder is None or not CheckpointPolicy.parse(recovery.checkpoint).enabled:
        return None
    return CheckpointPlan(
        holder_url=holder, policy=recovery.checkpoint, lease_ttl_s=recovery.checkpoint_lease_ttl_s
    )


def resume_on(recovery: RecoveryConfig, holder: str | None) -> str | None:
    """The worker a migration should try first: the request's holder (nearest cache first:
    it resumes from its own tier, nothing travels); None: no preference."""
    if holder is None or not CheckpointPolicy.parse(recovery.checkpoint).enabled:
        return None
    return holder


# Cache sources named to a resume: each costs the resuming worker one lookup call.
MAX_CACHE_SOURCES = 3


def cache_sources(
    index_holders: Sequence[str], prefill_url: str | None, exclude: Collection[str]
) -> list[str]:
    """Workers whose prefix caches a resume should ask: those the KV-event index says hold
    the most of the request's blocks, then its prefill worker (which computed the prompt's
    KV and may still cache it even where the index has not caught up)."""
    urls = [u for u in index_holders if u not in exclude]
    if prefill_url is not None and prefill_url not in exclude and prefill_url not in urls:
        urls.append(prefill_url)
    return urls[:MAX_CACHE_SOURCES]


def source(
    recovery: RecoveryConfig, holder: str | None, caches: Sequence[str] = ()
) -> CheckpointSource | None:
    """Where a resume finds the request's KV: its latest checkpoint and the prefix caches
    that may hold its leading blocks (None: nowhere, or checkpoints off). The holder may be
    the resuming worker itself: its own tier is the nearest copy."""
    if not CheckpointPolicy.parse(recovery.checkpoint).enabled:
        return None
    if holder is None and not caches:
        return None
    return CheckpointSource(holder_url=holder, cache_urls=list(caches))
