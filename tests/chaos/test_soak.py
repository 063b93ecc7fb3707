"""CI's nemesis soak (`pdserve chaos --soak 60 --fault-interval-s 6 --seed 13`), as a user sees it.

One run with fixed seeds: a supervised cluster (local etcd, 2 prefill + 2 decode workers in
network namespaces where the machine allows, 2 routers), a fault-free phase, then 60 s of
mixed load while the nemesis applies a fault at least every 6 s (kills, pauses, damaged and
stalled transfers, a partition, etcd restarts). Asserted, as issue 16 sets them: 0 divergent
outputs, 0 lost or duplicated tokens, 0 leaked blocks, 0 requests past their deadline,
availability >= 99 % excluding requests whose router was killed, no process left behind; and
the stored history judges the same when read back.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
from pathlib import Path

import pytest

from pdlab.soak.check import check
from pdlab.soak.history import Phase, from_lines
from pdlab.soak.nemesis_plan import FaultKind
from pdlab.soak.report import SoakResult, render_report, write_history
from pdlab.soak.run import SoakConfig, run_soak_async

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not on PATH (etcd-server)"),
]

DURATION_S = 60.0
INTERVAL_S = 6.0
# The seed is chosen so that the plan strikes with every kind in KINDS at least once (checked
# below); 60 s at one fault every 3-6 s does that in less time than 90 s at 4-8 s did.
SEED = 13
# Every kind but the link faults (loss, slow link: tests/chaos/test_network_faults.py runs
# them on their own), in their declared order: the plan this seed gives with them is the one
# this soak was judged on (kills, pauses, transfer faults, a partition, etcd restarts).
KINDS = tuple(k for k in FaultKind if k not in (FaultKind.LOSS, FaultKind.SLOW_LINK))


@pytest.fixture(scope="module")
def soak(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> SoakResult:
    workdir = tmp_path_factory.mktemp("soak")
    config = SoakConfig(
        duration_s=DURATION_S,
        rate=2.0,
        seed=SEED,
        fault_interval_s=INTERVAL_S,
        fault_free_s=14.0,
        nemesis=KINDS,
        model=str(tiny_model_path),
        workdir=workdir,
    )
    result = asyncio.run(run_soak_async(config))
    write_history(result.history, workdir / "history.jsonl")
    print(render_report(result))  # shown with -s, and in the failure report
    return result


@pytest.mark.timeout(900)
def test_the_soak_meets_every_target(soak: SoakResult) -> None:
    v = soak.verdict
    assert v.violations == [], render_report(soak)
    assert v.passed, v.missed
    s = v.soak
    assert s.num_sent >= 100 and v.fault_free.num_sent >= 5
    assert (s.num_divergent, s.num_tokens_lost, s.num_tokens_duplicated) == (0, 0, 0)
    assert (v.num_leaked_blocks, s.num_past_deadline) == (0, 0)
    assert s.availability_excused >= 0.99
    assert soak.history.quiescence.processes_left == ()
    assert {w.name for w in soak.history.quiescence.workers} == {
        "prefill-0", "prefill-1", "decode-0", "decode-1",
    }  # fmt: skip


def test_faults_came_at_least_every_interval_and_overlapped(soak: SoakResult) -> None:
    applied = sorted((f for f in soak.history.faults if f.applied), key=lambda f: f.start_s or 0)
    assert len(applied) >= DURATION_S / INTERVAL_S
    starts = [0.0, *(f.start_s or 0.0 for f in applied), DURATION_S]
    # Skipped faults (a target still restarting) may widen a gap, never past two intervals.
    assert max(b - a for a, b in itertools.pairwise(starts)) <= 2 * INTERVAL_S
    # CI's one run of every process, transfer, partition and etcd fault.
    assert {f.kind for f in applied} == {k.value for k in KINDS}
    ends = [(f.start_s or 0.0, f.end_s or 0.0) for f in applied]
    assert any(a2 < e1 for (_, e1), (a2, _) in itertools.pairwise(ends))
    if soak.history.meta.netns_unavailable is None:
        assert any(f.kind == "partition" for f in applied)


def test_the_load_was_mixed_and_every_request_got_one_outcome(soak: SoakResult) -> None:
    soak_requests = [r for r in soak.history.requests if r.phase is Phase.SOAK]
    assert len({r.index for r in soak_requests}) == len(soak_requests)
    assert {r.api for r in soak_requests} == {"completions", "chat"}
    assert {r.stream for r in soak_requests} == {True, False}
    assert any(r.turn >= 1 for r in soak_requests)
    assert any(r.malformed for r in soak_requests)
    assert all(r.end_s - r.start_s <= r.deadline_s for r in soak_requests)


def test_the_stored_history_judges_the_same(soak: SoakResult, tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    write_history(soak.history, path)
    again = check(from_lines(path.read_text().splitlines()))
    assert again.missed == soak.verdict.missed
    assert again.soak.num_ok == soak.verdict.soak.num_ok
