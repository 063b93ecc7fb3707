"""Revisions for rollouts (`router/placement/revisions.py`): newest ready first, canary
shares, pinned requests stay where their tokens came from."""

from __future__ import annotations

from collections import Counter

from pdserve.protocol.worker_api import WorkerHealth
from pdserve.router.config import AffinityConfig
from pdserve.router.placement.affinity import AffinityPolicy, RouteQuery
from pdserve.router.placement.policy import WorkerView
from pdserve.router.placement.revisions import RevisionBook, choose, ready, restrict


def view(url: str, index: int, role: str, digest: str, draining: bool = False) -> WorkerView:
    health = WorkerHealth(
        worker_id=url, role=role, pid=1, fingerprint={}, fingerprint_digest=digest,
        transfer_address=None, max_model_len=512, block_size=16, num_blocks=64,
        num_free_blocks=64, num_pinned_blocks=0, num_running=0, num_waiting=0,
        num_active_leases=0,
        draining=draining,
    )  # fmt: skip
    return WorkerView(url, index, health, True)


OLD = [view("p0", 0, "prefill", "A"), view("d0", 1, "decode", "A")]


def seen(*views: list[WorkerView]) -> RevisionBook:
    book = RevisionBook()
    for vs in views:
        book.note(vs)
    return book


def test_the_newest_ready_revision_takes_new_requests() -> None:
    both = [*OLD, view("p1", 2, "prefill", "B"), view("d1", 3, "decode", "B")]
    book = seen(OLD, both)
    assert choose(both, book, ticket=0, colocated=False) == "B"


def test_a_revision_without_both_roles_is_not_ready_yet() -> None:
    half = [*OLD, view("p1", 2, "prefill", "B")]
    book = seen(OLD, half)
    assert not ready(half, "B", colocated=False) and ready(half, "A", colocated=False)
    assert choose(half, book, ticket=0, colocated=False) == "A"
    # Colocated, one decode-capable worker is enough.
    decode_only = [*OLD, view("d1", 2, "decode", "B")]
    assert choose(decode_only, seen(OLD, decode_only), ticket=0, colocated=True) == "B"


def test_draining_workers_do_not_make_a_revision_ready() -> None:
    draining = [view("p0", 0, "prefill", "A", draining=True), view("d0", 1, "decode", "A")]
    assert not ready(draining, "A", colocated=False)
    assert choose(draining, seen(draining), ticket=0, colocated=False) is None


def test_a_canary_gets_its_share_by_arrival_number() -> None:
    both = [*OLD, view("p1", 2, "prefill", "B"), view("d1", 3, "decode", "B")]
    book = seen(OLD, both)
    picks = Counter(choose(both, book, t, colocated=False, canary_weight=0.2) for t in range(2000))
    assert 0.15 < picks["B"] / 2000 < 0.25 and picks["A"] + picks["B"] == 2000
    # The same arrival number always lands on the same revision.
    assert choose(both, book, 7, False, 0.2) == choose(both, book, 7, False, 0.2)


def test_restrict_keeps_one_revision() -> None:
    both = [*OLD, view("d1", 3, "decode", "B")]
    assert [v.url for v in restrict(both, "B")] == ["d1"]
    assert restrict(both, None) == both


def test_a_pinned_request_is_placed_in_its_revision_only() -> None:
    both = [*OLD, view("p1", 2, "prefill", "B"), view("d1", 3, "decode", "B")]
    policy = AffinityPolicy(AffinityConfig(routing="load"))
    policy.revisions.note(OLD)
    fresh = RouteQuery([1, 2, 3], 8)
    assert [w.url for w in policy.rank_decode(both, fresh)] == ["d1"]
    pinned = RouteQuery([1, 2, 3], 8, revision="A")
    decode = policy.rank_decode(both, pinned)
    assert [w.url for w in decode] == ["d0"]
    prefill = policy.pick_prefill(both, decode[0], pinned)
    assert prefill is not None and prefill.url == "p0"


def test_a_pool_that_starts_mixed_serves_its_majority() -> None:
    mixed = [*OLD, view("d2", 2, "decode", "A"), view("p1", 3, "prefill", "B"),
             view("d1", 4, "decode", "B")]  # fmt: skip
    assert choose(mixed, seen(mixed), ticket=0, colocated=False) == "A"
