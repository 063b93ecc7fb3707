"""Worker selection: exact choices by load, role and fingerprint group."""

from __future__ import annotations

from pdserve.protocol.worker_api import Role, WorkerHealth
from pdserve.router.placement.policy import (
    WorkerView,
    compatible_digest,
    pick_prefill,
    rank_colocated,
    rank_decode,
)


def view(
    index: int,
    role: Role,
    digest: str = "A",
    free: int = 100,
    running: int = 0,
    inflight: int = 0,
    healthy: bool = True,
) -> WorkerView:
    health = WorkerHealth(
        worker_id=f"w{index}", role=role, pid=1, fingerprint={}, fingerprint_digest=digest,
        transfer_address=None, max_model_len=256, block_size=16, num_blocks=100,
        num_free_blocks=free, num_pinned_blocks=0, num_running=running, num_waiting=0,
        num_active_leases=0,
    )  # fmt: skip
    return WorkerView(f"http://w{index}", index, health, healthy, inflight)


def urls(views: list[WorkerView]) -> list[str]:
    return [v.url for v in views]


def test_majority_digest_wins_and_ties_go_to_the_first_worker() -> None:
    pool = [view(0, "decode", "B"), view(1, "decode", "A"), view(2, "prefill", "A")]
    assert compatible_digest(pool) == "A"
    assert compatible_digest([view(0, "decode", "B"), view(1, "decode", "A")]) == "B"
    # An unhealthy worker does not vote.
    assert compatible_digest([view(0, "decode", "B", healthy=False), view(1, "both")]) == "A"
    assert compatible_digest([]) is None


def test_decode_ranked_by_load_then_free_blocks_then_order() -> None:
    pool = [
        view(0, "decode", running=2),
        view(1, "decode", free=50),
        view(2, "both", free=80),
        view(3, "decode", free=80),
        view(4, "prefill"),
        view(5, "decode", inflight=1),
    ]
    assert urls(rank_decode(pool)) == [
        "http://w2",
        "http://w3",
        "http://w1",
        "http://w5",
        "http://w0",
    ]
    assert urls(rank_decode(pool, exclude={"http://w2"}))[0] == "http://w3"


def test_incompatible_or_unhealthy_workers_are_never_chosen() -> None:
    pool = [
        view(0, "decode", "A", running=5),
        view(1, "decode", "B"),  # minority fingerprint: never chosen, even idle
        view(2, "prefill", "A", running=3),
        view(3, "prefill", "B"),
        view(4, "decode", "A", healthy=False),
        view(5, "prefill", "A"),
    ]
    decode = rank_decode(pool)
    assert urls(decode) == ["http://w0"]
    prefill = pick_prefill(pool, decode[0])
    assert prefill is not None and prefill.url == "http://w5"
    assert pick_prefill(pool, decode[0], exclude={"http://w5"}).url == "http://w2"  # type: ignore[union-attr]
    assert pick_prefill(pool, decode[0], exclude={"http://w5", "http://w2"}) is None


def test_prefill_prefers_role_prefill_and_never_the_decode_worker() -> None:
    pool = [view(0, "both"), view(1, "both", running=1), view(2, "prefill", running=4)]
    decode = rank_decode(pool)[0]
    assert decode.url == "http://w0"
    assert pick_prefill(pool, decode).url == "http://w2"  # type: ignore[union-attr]
    assert pick_prefill(pool[:2], decode).url == "http://w1"  # type: ignore[union-attr]
    assert pick_prefill(pool[:1], decode) is None


def test_colocated_prefers_both_workers_then_decode_workers() -> None:
    """A whole request goes to `both` workers; a split pool re-colocated (the breaker, an
    operator) runs it on its decode workers, never on a prefill worker."""
    pool = [view(0, "decode"), view(1, "both", running=1), view(2, "both"), view(3, "prefill")]
    assert urls(rank_colocated(pool)) == ["http://w2", "http://w1"]
    split = [view(0, "decode", running=1), view(1, "decode"), view(2, "prefill")]
    assert urls(rank_colocated(split)) == ["http://w1", "http://w0"]
    assert rank_colocated([view(0, "prefill")]) == []
