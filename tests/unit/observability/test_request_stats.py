"""Per-request metrics read from a timeline: exact values from hand-built timelines."""

from __future__ import annotations

import pytest

from pdserve.observability.request_stats import BREAKER_DETAIL, request_stats
from pdserve.protocol.request_state import Reason, RequestState, RequestTimeline, Transition

MS = 1_000_000


def _timeline(
    states: list[tuple[str, int, str] | tuple[str, int, str, Reason]], mode: str = "disagg"
) -> RequestTimeline:
    history = [
        Transition(RequestState[s[0]], s[1], 0.0, s[2], s[3] if len(s) == 4 else None)
        for s in states
    ]
    return RequestTimeline("cmpl-1", mode, history)


def test_a_disaggregated_request_with_a_reprefill() -> None:
    t = _timeline(
        [
            ("RECEIVED", 0, ""),
            ("ROUTED", 1 * MS, ""),
            ("RESERVED", 3 * MS, "tid"),
            ("PREFILLING", 3 * MS, ""),
            ("PREFILLED", 13 * MS, ""),
            ("TRANSFERRING", 13 * MS, ""),
            ("RETRYING", 20 * MS, "handoff failed, re-prefill: KVNotReady", Reason.REPREFILL),
            ("ROUTED", 21 * MS, ""),
            ("RESERVED", 22 * MS, ""),
            ("PREFILLING", 22 * MS, ""),
            ("PREFILLED", 30 * MS, "re-prefilled"),
            ("TRANSFERRING", 30 * MS, ""),
            ("COMMITTED", 34 * MS, ""),
            ("DECODING", 35 * MS, ""),
            ("FINISHED", 100 * MS, "length"),
        ]
    )
    assert t.record_tokens(1, 13 * MS) is None  # the first token: no gap yet
    assert t.record_tokens(2, 39 * MS) == pytest.approx(0.013)  # 26 ms over 2 tokens
    assert t.record_tokens(0, 50 * MS) is None
    t.record_tokens(1, 53 * MS)
    s = request_stats(t)
    assert s.ttft_s == pytest.approx(0.013)
    assert s.e2e_s == pytest.approx(0.1)
    assert s.tpot_s == pytest.approx(0.040 / 3)  # 13 ms → 53 ms over 3 tokens after the first
    assert s.queue_s == pytest.approx(0.003)  # the first reservation
    # The attempt that succeeded.
    assert s.phases["prefill"] == pytest.approx(0.008)
    assert s.phases["transfer"] == pytest.approx(0.004)
    assert s.phases["handoff"] == pytest.approx(0.005)
    assert s.retries == ("reprefill",) and s.fallbacks == () and s.num_migrations == 0


def test_a_failed_request_has_no_e2e_nor_tpot() -> None:
    t = _timeline(
        [("RECEIVED", 0, ""), ("ROUTED", MS, ""), ("FAILED", 2 * MS, "boom")], "colocated"
    )
    s = request_stats(t)
    assert (s.ttft_s, s.e2e_s, s.tpot_s, s.queue_s, s.phases) == (None, None, None, None, {})


def test_a_breaker_fallback_and_a_local_prefill_are_fallbacks() -> None:
    t = _timeline(
        [
            ("RECEIVED", 0, BREAKER_DETAIL, Reason.BREAKER_OPEN),
            ("ROUTED", MS, ""),
            ("DECODING", 2 * MS, ""),
        ]
    )
    assert request_stats(t).fallbacks == ("breaker_open",)
    t = _timeline(
        [
            ("RECEIVED", 0, ""),
            ("ROUTED", MS, ""),
            ("RESERVED", 2 * MS, ""),
            ("PREFILLING", 2 * MS, ""),
            ("RETRYING", 3 * MS, "local prefill: WorkerUnreachable", Reason.LOCAL_PREFILL),
            ("ROUTED", 4 * MS, ""),
            ("DECODING", 5 * MS, ""),
            ("RETRYING", 6 * MS, "migrate after 3 tokens: cut", Reason.MIGRATION),
        ]
    )
    s = request_stats(t)
    assert s.retries == ("local_prefill", "migration")
    assert s.fallbacks == ("local_prefill",) and s.num_migrations == 1


def test_retry_reasons_come_from_the_enum_not_the_words() -> None:
    # The detail text is for people: a reworded detail changes no metric label.
    t = _timeline(
        [
            ("RECEIVED", 0, ""),
            ("RETRYING", MS, "anything at all", Reason.LOCAL_PREFILL),
            ("ROUTED", 2 * MS, ""),
            ("RETRYING", 3 * MS, "local prefill: looks like a fallback", Reason.RESUME_FAILED),
        ]
    )
    assert request_stats(t).retries == ("local_prefill", "resume_failed")
    assert {r.value for r in Reason} >= {
        "reserve_refused",
        "worker_refused",
        "prefill_failed",
        "reprefill",
        "local_prefill",
        "migration",
        "resume_failed",
    }


def test_retrying_without_a_reason_is_refused() -> None:
    t = RequestTimeline("r", "disagg")
    with pytest.raises(ValueError, match="RETRYING needs a Reason"):
        t.advance(RequestState.RETRYING, "why")
    assert t.state is RequestState.RECEIVED
    t.retry(Reason.LOCAL_PREFILL, "no prefill worker")
    assert t.state is RequestState.RETRYING
