"""The one writer of a request's timeline: every event of a request's life, named.

Flows, the API layer and the dispatcher report what happened through these functions and
never move a `RequestTimeline` themselves, so the states a request goes through, and which
event puts it in which, are read in one place (the transitions themselves are checked by the
timeline's table, `protocol/request_state.py`). Pure: no I/O.
"""

from __future__ import annotations

from pdserve.protocol.request_state import Reason, RequestTimeline
from pdserve.protocol.request_state import RequestState as S
from pdserve.protocol.worker_api import TokenEvent
from pdserve.router.flows.flow import TokenChunk


def routed(timeline: RequestTimeline, detail: str) -> None:
    """Workers were chosen (or a resumption's worker)."""
    timeline.advance(S.ROUTED, detail)


def reserved(timeline: RequestTimeline, transfer_id: str) -> None:
    """A decode slot and its blocks are held for the request, under a lease."""
    timeline.advance(S.RESERVED, transfer_id)


def prefilling(timeline: RequestTimeline, prefill_url: str) -> None:
    """The prefill call went out."""
    timeline.advance(S.PREFILLING, prefill_url)


def prefilled(timeline: RequestTimeline, first_token_id: int) -> None:
    """The prefill answered with the first token."""
    timeline.advance(S.PREFILLED, f"first_token={first_token_id}")


def transferring(timeline: RequestTimeline, decode_url: str) -> None:
    """The decode side was asked to stream once the KV has landed."""
    timeline.advance(S.TRANSFERRING, decode_url)


def committed(timeline: RequestTimeline, handoff: str) -> None:
    """The decode side accepted verified KV (how it came: transport, bytes, canary)."""
    timeline.advance(S.COMMITTED, handoff)


def decoding(timeline: RequestTimeline, detail: str = "") -> None:
    """Tokens come from a decode worker."""
    timeline.advance(S.DECODING, detail)


def finished(timeline: RequestTimeline, reason: str) -> None:
    """The request is complete (the worker's finish reason, or the router's own)."""
    timeline.advance(S.FINISHED, reason)


def finished_by_worker(timeline: RequestTimeline, event: TokenEvent) -> TokenChunk:
    """The worker's last stream line: the request finishes with the worker's reason, and the
    client's last chunk carries it ("stop" where the worker gave none)."""
    finished(timeline, event.finish_reason or "")
    return TokenChunk.of_event(event, event.finish_reason or "stop")


def retrying(timeline: RequestTimeline, reason: Reason, detail: str = "") -> None:
    """A step failed and another follows, for `reason`."""
    timeline.retry(reason, detail)


def failed(timeline: RequestTimeline, detail: str) -> None:
    """The request ends without finishing."""
    timeline.fail(detail)


def tokens(timeline: RequestTimeline, num_tokens: int, now_ns: int) -> float | None:
    """`num_tokens` reached the client at `now_ns`; the gap since the last ones, in seconds."""
    return timeline.record_tokens(num_tokens, now_ns)
