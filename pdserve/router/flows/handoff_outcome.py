"""How one KV handoff ended, as the circuit breaker, the metrics and the timeline see it. Pure."""

from __future__ import annotations

import enum
from collections.abc import Callable

from pdserve.protocol.worker_api import TokenEvent


class Handoff(enum.Enum):
    """How one KV handoff ended, as the breaker and the metrics count it."""

    OK = "ok"  # the decode side committed verified KV
    FAILED = "failed"  # it never did
    SLOW = "slow"  # it did, far below the transport's expected rate (a failure for the breaker)


# (outcome, reason): told for every handoff.
KVOutcome = Callable[[Handoff, str], None]


def of_commit(event: TokenEvent) -> tuple[Handoff, str]:
    """A commit's outcome: OK, unless the decode side says the KV came far too slowly."""
    h = event.handoff
    if h is None or not h.slow:
        return Handoff.OK, ""
    return Handoff.SLOW, (
        f"slow KV transfer over {h.transport}: {h.num_bytes} bytes in {h.seconds:.3f} s"
    )


def detail(event: TokenEvent) -> str:
    """The commit's line in the request's timeline: transport, bytes, seconds, canary."""
    h = event.handoff
    if h is None:
        return ""
    return (
        f"transport={h.transport or 'none'} bytes={h.num_bytes} seconds={h.seconds}"
        f" canary={h.canary}" + (" SLOW" if h.slow else "")
    )
