"""The soak checker on hand-made histories: a clean one passes, and each broken rule fails it
with the figure or rule named; availability leaves out requests whose router was killed;
recovery times per fault kind; the JSON lines round trip."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pdlab.soak.check import check
from pdlab.soak.history import (
    Ending,
    FaultRecord,
    History,
    Phase,
    Quiescence,
    RequestRecord,
    SoakMeta,
    SoakTargets,
    WorkerQuiescence,
    from_lines,
    to_lines,
)

REF = (11, 12, 13, 14)
META = SoakMeta(
    seed=1,
    duration_s=10.0,
    rate=1.0,
    nemesis=("kill-router",),
    fault_interval_s=5.0,
    fault_free_s=5.0,
)
REST = Quiescence(workers=(WorkerQuiescence("decode-0", True), WorkerQuiescence("prefill-0", True)))


def req(index: int, phase: Phase = Phase.SOAK, **kw: object) -> RequestRecord:
    base: dict[str, object] = {
        "phase": phase,
        "index": index,
        "api": "completions",
        "stream": True,
        "deadline_s": 40.0,
        "expected_token_ids": REF,
        "expected_text": "abcd",
        "start_s": float(index),
        "end_s": index + 1.0,
        "routers": ("router-0",),
        "status": 200,
        "token_ids": REF,
        "text": "abcd",
        "finish_reason": "length",
        "workers": ("prefill-0", "decode-0"),
    }
    return RequestRecord(**{**base, **kw})  # type: ignore[arg-type]


def history(
    *requests: RequestRecord, faults: tuple[FaultRecord, ...] = (), **kw: object
) -> History:
    clean = [req(i, Phase.FAULT_FREE) for i in range(3)]
    return History(META, [*clean, *requests], list(faults), kw.get("rest", REST))  # type: ignore[arg-type]


def clean_soak() -> list[RequestRecord]:
    return [req(i) for i in range(5)]


def test_a_clean_history_passes_with_exact_figures() -> None:
    v = check(history(*clean_soak()))
    assert v.passed and v.violations == [] and v.soak.num_reference_ties == 0
    assert (v.soak.num_sent, v.soak.num_ok, v.soak.num_ok_tokens) == (5, 5, 20)
    assert v.soak.availability == v.soak.availability_excused == 1.0
    assert (v.goodput_req_s, v.fault_free_goodput_req_s, v.goodput_ratio) == (0.5, 0.6, 0.5 / 0.6)


@pytest.mark.parametrize(
    ("broken", "missed"),
    [
        (req(9, token_ids=(11, 12, 12, 14)), "1 divergent outputs"),
        (req(9, token_ids=(11, 12, 14)), "1 tokens lost"),
        (req(9, token_ids=(11, 12, 13, 13, 14)), "1 tokens duplicated"),
        (req(9, end_s=60.0), "1 requests past their deadline"),
        (req(9, ending=Ending.TIMEOUT, token_ids=()), "1 requests past their deadline"),
        (req(9, text="abce"), "1 x text_differs"),
        (
            req(9, status=500, ending=Ending.HTTP_ERROR, error_type="server_error", token_ids=()),
            "1 x internal_error",
        ),
        (req(9, ending=Ending.CUT, token_ids=(11,), finish_reason=None), "1 x cut"),
        (req(9, ending=Ending.UNREACHABLE, token_ids=(), status=None), "1 x unreachable"),
        (req(9, malformed="n_zero", expected_param="n", status=200), "1 x malformed_not_refused"),
        (
            req(9, malformed="n_zero", expected_param="n", status=400, error_param="prompt"),
            "1 x malformed_not_refused",
        ),
        (req(3), "1 x two_outcomes"),
        (req(9, ending=Ending.CLIENT_DISCONNECT, token_ids=(11, 13)), "1 divergent outputs"),
    ],
)
def test_each_broken_rule_fails_the_soak(broken: RequestRecord, missed: str) -> None:
    v = check(history(*clean_soak(), broken))
    assert not v.passed
    assert any(m.startswith(missed) for m in v.missed), v.missed


def test_typed_errors_cost_availability_but_break_no_rule() -> None:
    errors = [
        req(5, status=503, ending=Ending.HTTP_ERROR, error_type="server_error", token_ids=()),
        req(6, ending=Ending.STREAM_ERROR, error_type="server_error", token_ids=(11, 12)),
    ]
    v = check(history(*clean_soak(), *errors))
    assert v.violations == []
    assert (v.soak.num_ok, v.soak.num_typed_errors, v.soak.availability) == (5, 2, 5 / 7)
    assert v.soak.errors == {"503 server_error": 1, "stream server_error": 1}
    assert v.missed == [
        "availability 0.7143 excluding requests whose router was killed, target >= 0.99"
    ]


def test_requests_of_a_killed_router_are_excused_only_if_it_was_killed_meanwhile() -> None:
    kill = FaultRecord(0, "kill-router", ("router-1",), 5.0, True, start_s=6.5, end_s=8.0)
    cut = req(6, routers=("router-1",), ending=Ending.CUT, token_ids=(11, 12), finish_reason=None)
    other = req(7, routers=("router-0",), ending=Ending.CUT, token_ids=(), finish_reason=None)
    v = check(history(*clean_soak(), cut, faults=(kill,)))
    assert v.passed and v.soak.num_excused == 1
    assert (v.soak.availability, v.soak.availability_excused) == (5 / 6, 1.0)
    assert not check(history(*clean_soak(), cut, other, faults=(kill,))).passed
    late = dataclasses.replace(kill, start_s=30.0)
    assert not check(history(*clean_soak(), cut, faults=(late,))).passed


def test_a_client_that_left_early_with_a_prefix_is_served_as_expected() -> None:
    left = req(5, ending=Ending.CLIENT_DISCONNECT, token_ids=(11, 12), disconnect_after=2)
    malformed = req(
        6,
        malformed="bad_json",
        expected_param=None,
        status=400,
        token_ids=(),
        ending=Ending.HTTP_ERROR,
        error_type="invalid_request_error",
    )
    assert check(history(*clean_soak(), left, malformed)).passed


def test_a_cluster_that_does_not_come_to_rest_fails() -> None:
    leak = Quiescence(
        workers=(
            WorkerQuiescence("decode-0", True, pinned_idle=0, pinned_after=3),
            WorkerQuiescence("decode-1", False),
            WorkerQuiescence("prefill-0", True, num_running=1),
        ),
        processes_left=("router-0 pid 123",),
        given_up=("decode-1: exited 6 times within 60 s",),
    )
    v = check(history(*clean_soak(), rest=leak))
    assert v.num_leaked_blocks == 3
    assert sorted(v.missed) == sorted(
        [
            "3 leaked blocks (target 0)",
            "1 x given_up (target 0)",
            "1 x process_left (target 0)",
            "1 x work_left (target 0)",
            "1 x worker_down (target 0)",
        ]
    )


def test_a_divergent_fault_free_phase_fails_too() -> None:
    h = history(*clean_soak())
    h.requests[0] = req(0, Phase.FAULT_FREE, token_ids=(1, 2, 3, 4))
    v = check(h)
    assert "1 divergent outputs (target 0)" in v.missed
    assert "the fault-free phase served 2 of 3 requests as expected" in v.missed


def test_recovery_is_fault_start_to_the_first_good_request_through_the_target() -> None:
    faults = (
        FaultRecord(0, "kill-worker", ("decode-1",), 2.0, True, start_s=2.0, end_s=4.0),
        FaultRecord(1, "kill-worker", ("decode-0",), 3.0, True, start_s=3.5),
        FaultRecord(2, "pause-router", ("router-1",), 3.0, False, detail="not running"),
    )
    soak = [*clean_soak(), req(5, workers=("prefill-0", "decode-1"), end_s=7.5)]
    v = check(history(*soak, faults=faults))
    by_kind = {r.kind: r for r in v.recovery}
    kill = by_kind["kill-worker"]
    assert (kill.num_faults, kill.num_recovered) == (2, 2)
    assert kill.max_s == 7.5 - 2.0  # decode-1's first request after the kill ended at 7.5
    assert kill.p50_s == 5.0 - 3.5  # decode-0: request 4 started at 4.0, ended at 5.0
    assert "pause-router" not in by_kind and v.num_faults_skipped == 1


def test_targets_come_from_the_history() -> None:
    h = history(
        *clean_soak(),
        req(5, status=503, ending=Ending.HTTP_ERROR, error_type="server_error", token_ids=()),
    )
    h.meta = dataclasses.replace(META, targets=SoakTargets(min_availability=0.8))
    assert check(h).passed


def test_the_history_round_trips_through_json_lines() -> None:
    h = history(
        *clean_soak(),
        req(
            5,
            ending=Ending.CUT,
            token_ids=(11,),
            routers=("router-0", "router-1"),
            alternative_token_ids=((11, 7),),
            alternative_texts=("ax",),
        ),
        faults=(FaultRecord(0, "partition", ("prefill-0", "decode-1"), 1.0, True, 1.2, 4.0),),
        rest=Quiescence((WorkerQuiescence("decode-0", True, 1, 1),), ("x pid 1",), ()),
    )
    back = from_lines(list(to_lines(h)))
    assert back == h
    assert check(back).missed == check(h).missed
    with pytest.raises(ValueError, match="history line 2"):
        from_lines(['{"type": "meta", ' + next(iter(to_lines(h)))[1:], '{"type": "x"}'])
    assert math.isnan(check(History(META)).soak.availability)


def test_another_fault_free_output_of_the_request_is_accepted_and_counted() -> None:
    alt = (11, 12, 99, 98)
    tie = req(
        5, token_ids=alt, text="abXY", alternative_token_ids=(alt,), alternative_texts=("abXY",)
    )
    cut = req(
        6,
        ending=Ending.STREAM_ERROR,
        token_ids=(11, 12, 99),
        error_type="server_error",
        alternative_token_ids=(alt,),
        alternative_texts=("abXY",),
    )
    v = check(history(*clean_soak(), tie, cut))
    assert v.violations == [] and v.soak.num_reference_ties == 2
    wrong_text = dataclasses.replace(tie, text="abcd")
    assert "1 x text_differs (target 0)" in check(history(*clean_soak(), wrong_text)).missed
    other = dataclasses.replace(tie, token_ids=(11, 12, 99, 97))
    assert "1 divergent outputs (target 0)" in check(history(*clean_soak(), other)).missed
