"""Affinity placement: exact choices for given prefix indexes, sessions and loads."""

from __future__ import annotations

import pytest

from pdserve.engine.block_manager import prefix_block_hashes
from pdserve.errors import ConfigError
from pdserve.protocol.worker_api import Role, WorkerHealth
from pdserve.router.config import AffinityConfig
from pdserve.router.placement.affinity import AffinityPolicy, RouteQuery
from pdserve.router.placement.policy import WorkerView, rank_decode

BS = 16
# A conversation's history: 64 tokens the decode worker computed (4 whole blocks) ...
HISTORY = [(7 * i) % 1000 + 2 for i in range(65)]
# ... and the next turn: the history's 64 computed tokens plus 16 new ones (5 blocks).
NEXT = HISTORY[:64] + list(range(500, 516))


def view(
    index: int,
    role: Role = "both",
    digest: str = "A",
    free: int = 100,
    running: int = 0,
    inflight: int = 0,
    healthy: bool = True,
    pid: int = 1,
) -> WorkerView:
    health = WorkerHealth(
        worker_id=f"w{index}", role=role, pid=pid, fingerprint={}, fingerprint_digest=digest,
        transfer_address=None, max_model_len=2048, block_size=BS, num_blocks=100,
        num_free_blocks=free, num_pinned_blocks=0, num_running=running, num_waiting=0,
        num_active_leases=0,
    )  # fmt: skip
    return WorkerView(f"http://w{index}", index, health, healthy, inflight)


def urls(views: list[WorkerView]) -> list[str]:
    return [v.url for v in views]


def query(tokens: list[int], session: str | None = None, ticket: int = 0) -> RouteQuery:
    return RouteQuery(tokens, max_tokens=16, session_id=session, ticket=ticket)


def policy_with_history(
    pool: list[WorkerView], holder: str, session: str | None = None, **config: object
) -> AffinityPolicy:
    """A policy that saw one finished turn on `holder`: prompt HISTORY[:48], output the rest."""
    policy = AffinityPolicy(AffinityConfig(**config))  # type: ignore[arg-type]
    policy.record(pool, holder, None, HISTORY[:48], HISTORY[48:], session)
    return policy


def test_without_history_affinity_orders_like_least_load() -> None:
    pool = [view(0, running=2), view(1, free=50), view(2, free=80), view(3, inflight=1)]
    policy = AffinityPolicy()
    assert urls(policy.rank_decode(pool, query(NEXT))) == urls(rank_decode(pool))
    assert urls(policy.rank_decode(pool, query(NEXT))) == [
        "http://w2",
        "http://w1",
        "http://w3",
        "http://w0",
    ]


def test_score_counts_matched_and_missing_blocks_and_load() -> None:
    pool = [view(0, running=1), view(1)]
    policy = policy_with_history(pool, "http://w0")
    s0 = policy.score(pool[0], query(NEXT))
    assert (s0.num_matched_blocks, s0.num_missing_blocks, s0.num_busy, s0.cost) == (4, 1, 1, 5.0)
    s1 = policy.score(pool[1], query(NEXT))
    assert (s1.num_matched_blocks, s1.num_missing_blocks, s1.num_busy, s1.cost) == (0, 5, 0, 5.0)
    # The output's last token was sampled but never computed: a prompt of exactly the 65
    # history tokens still matches 4 blocks, not more.
    assert policy.num_matched_tokens(pool[0], query(HISTORY)) == 64


@pytest.mark.parametrize(
    ("holder_running", "expected"),
    [
        (0, ["http://w0", "http://w1"]),  # cost 1 vs 5
        (1, ["http://w0", "http://w1"]),  # cost 5 vs 5: more matched blocks wins the tie
        (2, ["http://w1", "http://w0"]),  # cost 9 vs 5: the load outweighs the prefix
    ],
)
def test_prefix_weighed_against_load(holder_running: int, expected: list[str]) -> None:
    pool = [view(0, running=holder_running), view(1)]
    policy = policy_with_history(pool, "http://w0")
    assert urls(policy.rank_decode(pool, query(NEXT))) == expected


def test_weights_are_configurable() -> None:
    pool = [view(0, running=1), view(1)]
    # Prefix ignored: pure load.
    assert urls(
        policy_with_history(pool, "http://w0", prefix_weight=0.0).rank_decode(pool, query(NEXT))
    ) == ["http://w1", "http://w0"]
    # Load ignored: the holder even when much busier.
    busy = [view(0, running=9), view(1)]
    assert urls(
        policy_with_history(busy, "http://w0", load_weight=0.0).rank_decode(busy, query(NEXT))
    ) == ["http://w0", "http://w1"]


def test_a_session_sticks_to_its_holder_even_against_the_prefix_score() -> None:
    pool = [view(0), view(1), view(2)]
    policy = policy_with_history(pool, "http://w1", session="chat-1")
    # w2 also computed the history (say, a replay), but the session's last turn ran on w1.
    policy.record(pool, "http://w2", None, HISTORY[:48], HISTORY[48:])
    assert policy.session_holder("chat-1") == "http://w1"
    assert urls(policy.rank_decode(pool, query(NEXT, "chat-1")))[0] == "http://w1"
    # Without the session the tie between w1 and w2 goes to list order.
    assert urls(policy.rank_decode(pool, query(NEXT))) == ["http://w1", "http://w2", "http://w0"]
    assert urls(policy.rank_decode(pool, query(list(range(900, 940)), "chat-1")))[0] == (
        "http://w1"
    )


@pytest.mark.parametrize(
    ("holder", "why"),
    [
        (view(1, healthy=False), "gone"),
        (view(1, free=5), "full: 6 blocks needed for 80 + 16 tokens"),
        (view(1, digest="B"), "incompatible fingerprint"),
        (view(1, role="prefill"), "not a decode worker"),
    ],
)
def test_a_session_falls_back_when_its_holder_cannot_serve(holder: WorkerView, why: str) -> None:
    good = [view(0), view(1), view(2)]
    policy = policy_with_history(good, "http://w1", session="chat-1")
    pool = [view(0), holder, view(2)]
    ranked = urls(policy.rank_decode(pool, query(NEXT, "chat-1")))
    assert ranked[0] == "http://w0", why
    assert "http://w1" not in ranked[:1]


def test_a_session_falls_back_when_its_holder_is_excluded_and_moves_with_the_next_turn() -> None:
    pool = [view(0), view(1)]
    policy = policy_with_history(pool, "http://w1", session="chat-1")
    ranked = policy.rank_decode(pool, query(NEXT, "chat-1"), exclude={"http://w1"})
    assert urls(ranked) == ["http://w0"]
    # w1 died; the next turn ran (re-prefilled) on w0: the session follows it.
    policy.record([view(0)], "http://w0", None, NEXT, [1, 2], "chat-1")
    assert policy.session_holder("chat-1") == "http://w0"
    assert urls(policy.rank_decode(pool, query(NEXT, "chat-1")))[0] == "http://w0"


def test_a_session_does_not_stick_to_a_restarted_holder() -> None:
    pool = [view(0), view(1)]
    policy = policy_with_history(pool, "http://w0", session="s")
    # w0 restarted (new pid) and has fewer free blocks: without the old session's pull, the
    # least-load order puts w1 first.
    restarted = [view(0, pid=2, free=50), view(1)]
    assert urls(policy.rank_decode(restarted, query(NEXT, "s"))) == ["http://w1", "http://w0"]
    assert urls(policy.rank_decode([view(0, free=50), view(1)], query(NEXT, "s")))[0] == (
        "http://w0"
    )


def test_a_restarted_worker_holds_nothing() -> None:
    pool = [view(0), view(1)]
    policy = policy_with_history(pool, "http://w0")
    assert policy.num_matched_tokens(pool[0], query(NEXT)) == 64
    assert policy.num_matched_tokens(view(0, pid=2), query(NEXT)) == 0
    assert policy.num_matched_tokens(view(0, pid=1), query(NEXT)) == 0  # the old entries are gone


def test_local_prefill_only_for_a_short_uncached_suffix_on_a_holder() -> None:
    pool = [view(0), view(1)]
    policy = policy_with_history(pool, "http://w0", local_prefill_threshold=16)
    assert policy.local_prefill(pool[0], query(NEXT))  # 80 - 64 = 16 uncached tokens
    assert not policy.local_prefill(pool[0], query([*NEXT, 1]))  # 17
    assert not policy.local_prefill(pool[1], query(NEXT))  # holds nothing
    assert not policy.local_prefill(pool[0], query(list(range(900, 910))))  # short, but no prefix
    off = policy_with_history(pool, "http://w0", local_prefill_threshold=0)
    assert not off.local_prefill(pool[0], query(NEXT))
    load = policy_with_history(pool, "http://w0", routing="load")
    assert not load.local_prefill(pool[0], query(NEXT))


def test_prefill_worker_chosen_by_its_own_prefix_then_role_then_load() -> None:
    pool = [view(0, "prefill"), view(1, "prefill", running=1), view(2, "both"), view(3, "decode")]
    policy = AffinityPolicy()
    decode = pool[3]
    # No history: role prefill, least loaded.
    assert policy.pick_prefill(pool, decode, query(NEXT)) == pool[0]
    # w1 prefilled the history's prompt (48 tokens = 3 blocks) but is busy:
    # w0 costs 5 (5 missing, idle), w1 costs 2 + 4 = 6, so w0 still wins ...
    policy.record(pool, "http://w3", "http://w1", HISTORY[:48], HISTORY[48:])
    assert policy.score(pool[1], query(NEXT)).num_matched_blocks == 3
    assert policy.pick_prefill(pool, decode, query(NEXT)) == pool[0]
    # ... and once w1 is idle its prefix wins (cost 2 vs 5).
    idle = [view(0, "prefill"), view(1, "prefill"), view(2, "both"), decode]
    assert policy.pick_prefill(idle, decode, query(NEXT)) == idle[1]
    # A `both` worker is never its own prefill partner.
    assert policy.pick_prefill([view(2, "both")], view(2, "both"), query(NEXT)) is None


def test_round_robin_rotates_by_ticket_over_list_order() -> None:
    pool = [view(2, "both"), view(0, "decode", running=5), view(1, "both"), view(3, "prefill")]
    policy = AffinityPolicy(AffinityConfig(routing="round_robin"))
    assert urls(policy.rank_decode(pool, query(NEXT, ticket=0))) == [
        "http://w0",
        "http://w1",
        "http://w2",
    ]
    assert urls(policy.rank_decode(pool, query(NEXT, ticket=4)))[0] == "http://w1"
    assert [policy.next_ticket() for _ in range(3)] == [0, 1, 2]
    prefill = policy.pick_prefill(pool, pool[1], query(NEXT, ticket=1))
    assert prefill is not None and prefill.url == "http://w3"  # the only role-prefill worker


def test_load_routing_is_the_plain_policy() -> None:
    pool = [view(0, running=1), view(1)]
    policy = policy_with_history(pool, "http://w0", session="s", routing="load")
    assert urls(policy.rank_decode(pool, query(NEXT, "s"))) == urls(rank_decode(pool))


def test_sessions_are_bounded_lru() -> None:
    pool = [view(0)]
    policy = AffinityPolicy(AffinityConfig(max_sessions=2))
    for session in ("a", "b", "a", "c"):
        policy.record(pool, "http://w0", None, [1, 2, 3], [4], session)
    assert policy.session_holder("b") is None
    assert policy.session_holder("a") == policy.session_holder("c") == "http://w0"


@pytest.mark.parametrize(
    "bad",
    [
        {"routing": "random"},
        {"prefix_weight": -1.0},
        {"load_weight": -0.5},
        {"local_prefill_threshold": -1},
        {"max_sessions": 0},
    ],
)
def test_config_rejects_bad_values(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        AffinityConfig(**bad)  # type: ignore[arg-type]


def test_a_resumes_cache_holders_come_from_the_index_most_blocks_first() -> None:
    pool = [view(0), view(1), view(2), view(3)]
    policy = AffinityPolicy()
    policy.index.insert("http://w1", prefix_block_hashes(HISTORY, BS)[:2], capacity=100)
    policy.index.insert("http://w2", prefix_block_hashes(HISTORY, BS), capacity=100)
    policy.index.insert("http://w3", prefix_block_hashes(NEXT[:16] + [1] * 48, BS), capacity=100)
    # w3 holds the first block too (the same 16 tokens), fewer than w2 and w1.
    assert policy.cache_holders(pool, HISTORY, exclude=()) == [
        "http://w2",
        "http://w1",
        "http://w3",
    ]
    assert policy.cache_holders(pool, HISTORY, exclude={"http://w2"}) == ["http://w1", "http://w3"]
    assert policy.cache_holders(pool, list(range(900, 964)), exclude=()) == []


def test_a_resume_never_offers_an_unhealthy_or_incompatible_cache_holder() -> None:
    # w1 is down and w2 runs other weights (digest B): both hold the whole history, and
    # neither may be a source, or a resume could adopt KV its worker cannot read (invariant 3).
    pool = [view(0), view(1, healthy=False), view(2, digest="B"), view(3)]
    policy = AffinityPolicy()
    for url in ("http://w1", "http://w2", "http://w3"):
        policy.index.insert(url, prefix_block_hashes(HISTORY, BS), capacity=100)
    assert policy.cache_holders(pool, HISTORY, exclude=()) == ["http://w3"]
