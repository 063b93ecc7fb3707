"""Router health's fingerprint groups: which pools cannot pair, with the fields that differ."""

from __future__ import annotations

from pdserve.protocol.worker_api import Role, WorkerHealth
from pdserve.router.placement.policy import (
    FieldDiff,
    WorkerView,
    fingerprint_groups,
    pairing_problems,
)

BASE: dict[str, str | int | float] = {"dtype": "float32", "quantization": "none", "rope_theta": 1e4}


def view(index: int, role: Role, healthy: bool = True, **fields: str | int | float) -> WorkerView:
    fingerprint = {**BASE, **fields}
    digest = ",".join(f"{k}={v}" for k, v in sorted(fingerprint.items()))
    health = WorkerHealth(
        worker_id=f"w{index}", role=role, pid=1, fingerprint=fingerprint,
        fingerprint_digest=digest, transfer_address=None, max_model_len=256, block_size=16,
        num_blocks=100, num_free_blocks=100, num_pinned_blocks=0, num_running=0, num_waiting=0,
        num_active_leases=0,
    )  # fmt: skip
    return WorkerView(f"http://w{index}", index, health, healthy)


def test_one_group_is_compatible_and_has_no_problems() -> None:
    pool = [view(0, "prefill"), view(1, "both"), view(2, "both")]
    (group,) = fingerprint_groups(pool)
    assert group.compatible and group.differs == ()
    assert group.worker_urls == ("http://w0", "http://w1", "http://w2")
    assert group.roles == ("both", "prefill")
    assert pairing_problems(pool, "disagg") == []
    assert pairing_problems(pool, "colocated") == []


def test_a_skewed_worker_is_its_own_group_naming_each_differing_field() -> None:
    pool = [
        view(0, "prefill"),
        view(1, "both"),
        view(2, "both", quantization="int8", rope_theta=5e5),
    ]
    main, skewed = fingerprint_groups(pool)
    assert main.compatible and not skewed.compatible
    assert skewed.worker_urls == ("http://w2",)
    assert skewed.differs == (
        FieldDiff("quantization", "int8", "none"),
        FieldDiff("rope_theta", 5e5, 1e4),
    )
    (problem,) = pairing_problems(pool, "disagg")
    assert problem.startswith("1 worker(s) (http://w2) cannot pair with the compatible group")
    assert problem.endswith("quantization 'int8' != 'none', rope_theta 500000.0 != 10000.0")


def test_prefill_and_decode_pools_that_differ_cannot_pair_in_disagg() -> None:
    # The decode pool is the majority; the only prefill worker has another dtype.
    pool = [view(0, "prefill", dtype="bfloat16"), view(1, "decode"), view(2, "decode")]
    problems = pairing_problems(pool, "disagg")
    assert len(problems) == 2
    assert "dtype 'bfloat16' != 'float32'" in problems[0]
    assert problems[1].startswith("disagg: no prefill worker in the compatible group")
    # Colocated needs a `both` worker, which this pool lacks.
    assert "colocated: no worker of role both in the compatible group" in pairing_problems(
        pool, "colocated"
    )


def test_unhealthy_workers_are_left_out_and_an_empty_pool_is_one_problem() -> None:
    assert fingerprint_groups([view(0, "both", healthy=False)]) == []
    assert pairing_problems([view(0, "both", healthy=False)], "disagg") == ["no healthy worker"]
    # A lone `both` worker cannot be its own prefill partner.
    assert pairing_problems([view(0, "both")], "disagg") == [
        "disagg: no prefill worker in the compatible group can pair with a decode worker"
        " (requests fall back to prefill on the decode worker)"
    ]
