"""Per-request metrics read from a timeline: exact values from hand-built timelines."""

from __future__ import annotations

import pytest

from pdserve.observability.request_stats import BREAKER_DETAIL, request_stats, retry_reason
from pdserve.router.state import RequestState, RequestTimeline, Transition

MS = 1_000_000


def _timeline(states: list[tuple[str, int, str]], mode: str = "disagg") -> RequestTimeline:
    history = [Transition(RequestState[s], ns, 0.0, d) for s, ns, d in states]
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
            ("RETRYING", 20 * MS, "handoff failed, re-prefill: KVNotReady"),
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
    t = _timeline([("RECEIVED", 0, BREAKER_DETAIL), ("ROUTED", MS, ""), ("DECODING", 2 * MS, "")])
    assert request_stats(t).fallbacks == ("breaker_open",)
    t = _timeline(
        [
            ("RECEIVED", 0, ""),
            ("ROUTED", MS, ""),
            ("RESERVED", 2 * MS, ""),
            ("PREFILLING", 2 * MS, ""),
            ("RETRYING", 3 * MS, "local prefill: WorkerUnreachable"),
            ("ROUTED", 4 * MS, ""),
            ("DECODING", 5 * MS, ""),
            ("RETRYING", 6 * MS, "migrate after 3 tokens: cut"),
        ]
    )
    s = request_stats(t)
    assert s.retries == ("local_prefill", "migration")
    assert s.fallbacks == ("local_prefill",) and s.num_migrations == 1


@pytest.mark.parametrize(
    ("detail", "mode", "reason"),
    [
        ("local prefill: x", "disagg", "local_prefill"),
        ("handoff failed, re-prefill: x", "disagg", "reprefill"),
        ("migrate after 4 tokens: x", "disagg", "migration"),
        ("prefill failed: x", "disagg", "prefill_failed"),
        ("migration 1 failed: x", "disagg", "resume_failed"),
        ("local prefill 2 failed: x", "disagg", "resume_failed"),
        (
            "affinity: http://d holds the prefix, local prefill of the suffix 1 failed: x",
            "disagg",
            "resume_failed",
        ),
        ("worker http://d: 503 NoCapacity", "disagg", "reserve_refused"),
        ("worker http://w: 503 NoCapacity", "colocated", "worker_refused"),
    ],
)
def test_retry_reasons_are_a_bounded_set(detail: str, mode: str, reason: str) -> None:
    assert retry_reason(detail, mode) == reason
