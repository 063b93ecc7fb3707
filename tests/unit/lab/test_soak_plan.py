"""The soak's seeded plans: the same seed gives the same load and faults, the rate and mix are
what was asked, faults come at least every interval and overlap, and the nemesis never takes
the last live member of a group; bad names are refused naming the flag."""

from __future__ import annotations

import itertools

import pytest

from pdlab.soak.nemesis_plan import (
    ALL_FAULTS,
    ClusterShape,
    FaultKind,
    parse_nemesis,
    plan_faults,
)
from pdlab.soak.plan import Api, LoadMix, plan_load
from pdserve.cli import main
from pdserve.errors import ConfigError

SHAPE = ClusterShape(("prefill-0", "prefill-1"), ("decode-0", "decode-1"), ("router-0", "router-1"))


def test_the_same_seed_gives_the_same_plans_and_another_seed_others() -> None:
    assert plan_load(7, 60, 2.0) == plan_load(7, 60, 2.0)
    assert plan_load(7, 60, 2.0) != plan_load(8, 60, 2.0)
    assert plan_faults(7, 60, ALL_FAULTS, SHAPE) == plan_faults(7, 60, ALL_FAULTS, SHAPE)


def test_the_load_has_the_rate_and_every_kind_of_request() -> None:
    plan = plan_load(3, 600, 2.0)
    assert 1000 < len(plan) < 1400  # 1200 expected
    assert [r.index for r in plan] == list(range(len(plan)))
    assert all(0 <= r.at_s < 600 for r in plan)
    kinds = {
        "chat": any(r.api is Api.CHAT for r in plan),
        "completions": any(r.api is Api.COMPLETIONS and r.new_token_ids for r in plan),
        "stream": any(r.stream for r in plan),
        "whole": any(not r.stream for r in plan),
        "greedy": any(r.temperature == 0 and r.seed is None for r in plan),
        "seeded": any(r.temperature > 0 and r.seed is not None for r in plan),
        "long": any(len(r.new_token_ids) >= 256 or len(r.new_text.split()) >= 150 for r in plan),
        "sessions": any(r.turn >= 2 for r in plan),
        "disconnect": any(r.disconnect_after for r in plan),
        "malformed": any(r.malformed for r in plan),
    }
    assert all(kinds.values()), kinds
    for r in plan:
        if r.disconnect_after is not None:
            assert r.stream and 1 <= r.disconnect_after < r.max_tokens
        if r.turn:
            first = next(p for p in plan if p.session == r.session and p.turn == 0)
            assert (r.api, r.at_s) == (first.api, first.at_s) and r.think_s > 0


def test_faults_come_at_least_every_interval_and_overlap() -> None:
    faults = plan_faults(11, 600, ALL_FAULTS, SHAPE, max_interval_s=8.0)
    starts = [f.at_s for f in faults]
    gaps = [b - a for a, b in zip([0.0, *starts], [*starts, 600.0], strict=True)]
    assert max(gaps) <= 8.0 + 1e-9
    assert {f.kind for f in faults} == set(FaultKind)
    lasting = [f for f in faults if f.duration_s]
    assert any(a.at_s + a.duration_s > b.at_s for a, b in itertools.pairwise(faults)) and lasting


@pytest.mark.parametrize("seed", range(5))
def test_the_nemesis_leaves_a_live_decode_worker_and_router(seed: int) -> None:
    faults = plan_faults(seed, 600, ALL_FAULTS, SHAPE, max_interval_s=4.0)
    away = {"kill-worker": 12.0, "kill-router": 6.0}
    groups = {"decode": SHAPE.decode, "router": SHAPE.routers}
    windows = [
        (f.at_s, f.at_s + f.duration_s + away.get(f.kind, 0.0), f.targets[0])
        for f in faults
        if f.kind.startswith(("kill-", "pause-"))
    ]
    for t in [w[0] for w in windows]:
        down = {name for start, end, name in windows if start <= t < end}
        for members in groups.values():
            assert set(members) - down, (t, down)
    transfer = [f for f in faults if f.rules]
    assert transfer and all(f.targets[0] in SHAPE.prefill for f in transfer)
    for f in faults:
        if f.kind is FaultKind.PARTITION:
            assert f.targets[0] in SHAPE.prefill and f.targets[1] in SHAPE.decode


def test_both_prefill_workers_may_be_away_together() -> None:
    """Decode workers prefill locally then: some plan must take both prefill workers out."""

    def both_down(seed: int) -> bool:
        faults = plan_faults(seed, 600, ALL_FAULTS, SHAPE, max_interval_s=4.0)
        windows = [(f.at_s, f.at_s + f.duration_s + (12.0 if f.kind == "kill-worker" else 0.0),
                    f.targets[0]) for f in faults if f.kind in ("kill-worker", "pause-worker")]  # fmt: skip
        return any(
            set(SHAPE.prefill) <= {n for s, e, n in windows if s <= t < e} for t, _, _ in windows
        )

    assert any(both_down(seed) for seed in range(5))


def test_link_faults_strike_one_worker_at_a_time() -> None:
    faults = plan_faults(3, 600, (FaultKind.LOSS, FaultKind.SLOW_LINK), SHAPE, max_interval_s=4.0)
    assert {f.kind for f in faults} == {FaultKind.LOSS, FaultKind.SLOW_LINK}
    for f in faults:
        assert len(f.targets) == 1 and f.targets[0] in (*SHAPE.prefill, *SHAPE.decode)
        assert 3.0 <= f.duration_s <= 8.0
    for a in faults:
        for b in faults:
            overlap = a.at_s < b.at_s < a.at_s + a.duration_s
            assert not (overlap and a.targets == b.targets), (a, b)


def test_nemesis_names_are_parsed_and_bad_ones_named() -> None:
    assert parse_nemesis("all") == ALL_FAULTS
    assert parse_nemesis("kill-worker, stall,kill-worker") == (
        FaultKind.KILL_WORKER,
        FaultKind.STALL,
    )
    with pytest.raises(ConfigError, match=r"--nemesis: unknown fault 'kill-etcd'"):
        parse_nemesis("kill-worker,kill-etcd")
    with pytest.raises(ConfigError, match="--nemesis: no fault named"):
        parse_nemesis(" , ")
    assert plan_faults(1, 60, (FaultKind.ETCD_RESTART,), ClusterShape((), (), (), None)) == []


def test_bad_mixes_and_rates_are_refused() -> None:
    with pytest.raises(ConfigError, match="chat"):
        LoadMix(chat=1.5)
    with pytest.raises(ConfigError, match="rate"):
        plan_load(1, 10, 0.0)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--soak", "abc"], "--soak"),
        (["--soak", "-5"], "--soak"),
        (["--soak", "0s"], "--soak"),
        (["--soak", "60", "--rate", "0"], "--rate"),
        (["--soak", "60", "--rate", "fast"], "--rate"),
        (["--soak", "60", "--nemesis", "kill-worker,kill-etcd"], "--nemesis"),
        (["--soak", "60", "--fault-interval-s", "0"], "--fault-interval-s"),
        (["--soak", "60", "--fault-free-s", "-1"], "--fault-free-s"),
        (["--soak", "60", "--seed", "x"], "--seed"),
        (["--soak", "60", "--min-availability", "1.5"], "--min-availability"),
    ],
)
def test_bad_soak_flags_exit_2_naming_the_flag_before_anything_starts(
    flags: list[str],
    named: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pdlab.soak.run as soak

    def never(*args: object, **kwargs: object) -> int:
        raise AssertionError("the soak started")

    monkeypatch.setattr(soak, "run_soak", never)
    assert main(["chaos", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve chaos: error: ") and named in err and err.count("\n") == 1


def test_a_soak_without_etcd_stops_before_any_process_saying_what_to_install(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pdserve.supervise.etcd as etcd

    monkeypatch.setattr(etcd.shutil, "which", lambda name: None)
    assert main(["chaos", "--soak", "10", "--no-netns"]) == 2
    assert "etcd is not on PATH (Debian: apt-get install etcd-server)" in capsys.readouterr().err
