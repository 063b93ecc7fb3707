"""The holder's store (puts committed only once verified, owner leases, pulls that check every
block before sending) and the router's choice of holder, without sockets: a fake receiver and
sender stand for the KV data plane, a fake clock for time."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from checkpoint_fakes import FakeSender
from pydantic import ValidationError
from waiting import until

from pdserve.checkpoint.host_tier import HostTier
from pdserve.engine.block_manager import prefix_block_hashes
from pdserve.errors import CheckpointRefused, PeerCallError
from pdserve.protocol.checkpoint_api import CheckpointLookup, CheckpointPut, CheckpointSend
from pdserve.protocol.worker_api import (
    CheckpointPlan,
    KVEndpoint,
    Reservation,
    Role,
    SignedReservation,
    WorkerHealth,
)
from pdserve.router.config import RecoveryConfig
from pdserve.router.flows.checkpoint_plan import (
    MAX_CACHE_SOURCES,
    cache_sources,
    choose_holder,
    plan,
    resume_on,
    source,
)
from pdserve.router.placement.policy import WorkerView
from pdserve.transfer.receiver import IncomingTransfer
from pdserve.worker.checkpoint.resume import Path, _reason
from pdserve.worker.checkpoint.store import CheckpointStore
from pdserve.worker.engine_loop import EngineInfo
from pdserve.worker.kv.outbox import Destination

BS = 4
BLOCK_BYTES = 8
INFO = EngineInfo({}, "fp-a", 1, BS, BLOCK_BYTES, "float32", 64, 1024)
TOKENS = list(range(100, 112))  # three blocks


class FakeReceiver:
    def __init__(self) -> None:
        # This process's instance, named in the reservations the store makes.
        self.instance = bytes.fromhex("c3" * 8)
        self.expected: dict[bytes, IncomingTransfer] = {}
        self.fenced: list[bytes] = []
        # What the store held when each fence began: the order the store promises (fence first).
        self.held_at_fence: list[int] = []
        self.tier: HostTier | None = None

    def expect(self, incoming: IncomingTransfer) -> None:
        self.expected[incoming.plan.transfer_id] = incoming

    async def fence(self, transfer_id: bytes) -> None:
        self.expected.pop(transfer_id, None)
        self.held_at_fence.append(self.tier.num_blocks if self.tier is not None else -1)
        self.fenced.append(transfer_id)

    def land(self, data: bytes, value_digest: bytes = b"") -> None:
        """The one expected transfer arrives verified, every block filled with `data` (and
        the writer's value digest in its Commit)."""
        (incoming,) = self.expected.values()
        incoming.session = SimpleNamespace(value_digest=value_digest)  # type: ignore[assignment]
        for view in incoming.blocks:
            view[:] = data * (len(view) // len(data))
        incoming.on_verified()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _store(capacity_blocks: int = 8) -> tuple[CheckpointStore, FakeReceiver, FakeSender, Clock]:
    receiver, sender, clock = FakeReceiver(), FakeSender(BLOCK_BYTES), Clock()
    endpoint = KVEndpoint(transport="tcp", address="127.0.0.1:1")
    store = CheckpointStore(
        HostTier(capacity_blocks * BLOCK_BYTES, BS, BLOCK_BYTES),
        INFO,
        receiver,  # type: ignore[arg-type]
        lambda: [endpoint],
        sender,  # type: ignore[arg-type]
        put_timeout_s=1.0,
        clock=clock,
    )
    receiver.tier = store.tier
    return store, receiver, sender, clock


def _put(owner: str, start: int, end: int, ttl_s: float = 5.0) -> CheckpointPut:
    parent = prefix_block_hashes(TOKENS, BS)[start - 1] if start else 0
    blocks = [TOKENS[i * BS : (i + 1) * BS] for i in range(start, end)]
    return CheckpointPut(
        owner=owner,
        fingerprint_digest="fp-a",
        parent_hash=parent,
        first_version=(start + 1) * BS,
        block_tokens=blocks,
        lease_ttl_s=ttl_s,
    )


def _send_body(num_blocks: int, adopt: str | None = None) -> CheckpointSend:
    reservation = Reservation(
        request_id="pull",
        transfer_id="00" * 16,
        capability_token="00" * 16,
        endpoints=[KVEndpoint(transport="tcp", address="127.0.0.1:2")],
        lease_epoch=0,
        num_cached_tokens=0,
        lease_ttl_s=5.0,
    )
    signed = SignedReservation(reservation=reservation, expires_at_s=0.0, signature="")
    return CheckpointSend(
        token_ids=TOKENS[: num_blocks * BS],
        fingerprint_digest="fp-a",
        reservation=signed,
        adopt_owner=adopt,
    )


DEST = Destination(b"0" * 16, b"0" * 16, "tcp", ("127.0.0.1", 2), 0, 0)


def test_a_put_is_held_once_verified_then_pulled_adopted_and_released() -> None:
    async def scenario() -> None:
        store, receiver, sender, clock = _store()
        reservation = store.put(_put("r1", 0, 2))
        assert reservation.lease_epoch == 0 and reservation.request_id == "r1@4"
        lookup = CheckpointLookup(token_ids=TOKENS, fingerprint_digest="fp-a")
        assert store.lookup(lookup).num_blocks == 0  # not verified yet: not held
        receiver.land(b"\x07")
        # Wait on what the store shows (the fence returning and the commit are two loop turns
        # apart), then check the writer was fenced while nothing was held yet.
        await until(lambda: store.lookup(lookup).num_blocks == 2)
        assert receiver.held_at_fence == [0]
        assert store.lookup(lookup).version == 8
        sent = await store.send(_send_body(2, adopt="r1.m1"), DEST)
        assert (sent.num_blocks, sent.num_bytes) == (2, 16)
        assert sender.sent == [("pull", TOKENS[:8], [b"\x07" * BLOCK_BYTES] * 2)]
        # r1 ended (its writer died: its lease lapses); the adopting owner keeps the blocks.
        clock.now = 6.0
        store.renew("r1.m1", 5.0)
        assert store.reap() == 1 and store.tier.num_blocks == 2
        store.release("r1.m1")
        assert store.tier.num_blocks == 0 and store.tier.reserved_bytes == 0
        store.tier.check_invariants()
        await store.aclose()

    asyncio.run(scenario())


def test_a_put_never_verified_gives_its_room_back() -> None:
    async def scenario() -> None:
        store, receiver, _, _ = _store()
        store.put(_put("r1", 0, 3))
        assert store.tier.reserved_bytes == 3 * BLOCK_BYTES
        await until(lambda: store.tier.reserved_bytes == 0)  # the put timeout (1 s) passed
        assert store.tier.num_blocks == 0
        assert receiver.fenced and not receiver.expected
        await store.aclose()

    asyncio.run(scenario())


def test_a_put_whose_owner_was_released_in_flight_is_not_kept() -> None:
    async def scenario() -> None:
        store, receiver, _, _ = _store()
        store.put(_put("r1", 0, 1))
        store.release("r1")  # the request ended while its bytes were on the way
        receiver.land(b"\x01")
        await until(lambda: store.tier.reserved_bytes == 0)
        assert store.tier.num_blocks == 0
        await store.aclose()

    asyncio.run(scenario())


def test_a_pull_refuses_changed_bytes_and_missing_blocks_before_sending() -> None:
    async def scenario() -> None:
        store, receiver, sender, _ = _store()
        store.put(_put("r1", 0, 2))
        receiver.land(b"\x05")
        await until(lambda: store.tier.num_blocks == 2)  # committed: held
        with pytest.raises(CheckpointRefused) as missing:
            await store.send(_send_body(3), DEST)  # the third block was never put
        assert missing.value.reason == "missing"
        entry = next(iter(store.tier._entries.values()))
        entry.data[0] ^= 0xFF  # a bit flipped in host memory
        with pytest.raises(CheckpointRefused) as changed:
            await store.send(_send_body(2), DEST)
        assert changed.value.reason == "checksum"
        assert not sender.sent
        assert store.tier.refused["checksum"] == 1 and store.tier.refused["missing"] == 1
        with pytest.raises(CheckpointRefused) as other:
            store.lookup(CheckpointLookup(token_ids=TOKENS, fingerprint_digest="fp-b"))
        assert other.value.reason == "fingerprint"
        await store.aclose()

    asyncio.run(scenario())


def test_a_full_holder_refuses_before_any_byte_travels() -> None:
    async def scenario() -> None:
        store, receiver, _, _ = _store(capacity_blocks=2)
        with pytest.raises(CheckpointRefused) as full:
            store.put(_put("r1", 0, 3))
        assert full.value.reason == "full" and not receiver.expected
        await store.aclose()

    asyncio.run(scenario())


def _view(url: str, role: Role, running: int = 0, index: int = 0) -> WorkerView:
    health = WorkerHealth(
        worker_id=url, role=role, pid=1, fingerprint={}, fingerprint_digest="fp-a",
        transfer_address=None, max_model_len=2048, block_size=BS, num_blocks=100,
        num_free_blocks=100, num_pinned_blocks=0, num_running=running, num_waiting=0,
        num_active_leases=0,
    )  # fmt: skip
    return WorkerView(url, index, health, True)


def test_the_holder_is_another_decode_worker_and_a_migration_keeps_it() -> None:
    views = [_view("p", "prefill"), _view("d1", "decode"), _view("d2", "decode", running=3),
             _view("d3", "both", running=1)]  # fmt: skip
    assert choose_holder(views, "d1") == "d3"  # least loaded, never itself, never prefill
    assert choose_holder(views, "d3", keep="d2") == "d2"  # the migration keeps its holder
    assert choose_holder(views, "d2", keep="d2") in ("d1", "d3")  # but never on itself
    assert choose_holder([_view("d1", "decode")], "d1") is None
    off, on = RecoveryConfig(), RecoveryConfig(checkpoint="every-2")
    assert plan(off, "d2") is None and source(off, "d2") is None
    p = plan(on, "d2")
    assert p is not None and (p.holder_url, p.policy) == ("d2", "every-2")
    assert plan(on, None) is None
    assert resume_on(on, "d2") == "d2" and resume_on(off, "d2") is None
    assert resume_on(on, None) is None


def test_holder_failures_map_to_bounded_reasons() -> None:
    assert _reason(PeerCallError("h", 0, "", "refused")) == "holder_unreachable"
    assert _reason(PeerCallError("h", 409, "CheckpointRefused", "x")) == "refused"
    assert _reason(PeerCallError("h", 500, "EngineError", "x")) == "holder_error"
    cache = Path.PEER_CACHE
    assert _reason(PeerCallError("c", 0, "", "refused"), cache) == "cache_unreachable"
    assert _reason(PeerCallError("c", 409, "CheckpointRefused", "x"), cache) == "cache_refused"
    assert _reason(PeerCallError("c", 500, "EngineError", "x"), cache) == "cache_error"


def test_a_resume_asks_the_index_holders_then_the_prefill_worker_never_a_dead_one() -> None:
    # The index's holders, most first, then the prefill worker; the dead and the resuming
    # worker are never named, nor anyone twice, and the list is bounded.
    assert cache_sources(["d2", "d1"], "p", exclude={"d1"}) == ["d2", "p"]
    assert cache_sources(["p", "d2"], "p", exclude=()) == ["p", "d2"]
    assert cache_sources([], "p", exclude={"p"}) == []
    many = [f"w{i}" for i in range(10)]
    assert cache_sources(many, "p", exclude=()) == many[:MAX_CACHE_SOURCES]
    on, off = RecoveryConfig(checkpoint="every-2"), RecoveryConfig()
    both = source(on, "h", ["p"])
    assert both is not None and (both.holder_url, both.cache_urls) == ("h", ["p"])
    only_cache = source(on, None, ["p"])  # the holder is gone: the caches still help
    assert only_cache is not None and only_cache.holder_url is None
    assert source(on, None, []) is None and source(off, "h", ["p"]) is None


def test_a_plan_with_an_unknown_policy_is_bad_input_naming_the_field() -> None:
    with pytest.raises(ValidationError, match=r"checkpoint\.policy: 'every-0'"):
        CheckpointPlan(holder_url="http://h", policy="every-0")
    assert CheckpointPlan(holder_url="http://h", policy="every-3").policy == "every-3"


def test_a_lookup_for_a_checkable_prefix_ends_at_a_block_with_a_value_digest() -> None:
    async def scenario() -> None:
        store, receiver, sender, _ = _store()
        store.put(_put("r1", 0, 2))
        receiver.land(b"\x01", value_digest=b"digest-of-position-7")
        await until(lambda: store.tier.num_blocks == 2)
        store.put(_put("r1", 2, 3))
        receiver.land(b"\x02")  # a put without a digest (the canary is off at its writer)
        await until(lambda: store.tier.num_blocks == 3)
        plain = CheckpointLookup(token_ids=TOKENS, fingerprint_digest="fp-a")
        checkable = CheckpointLookup(
            token_ids=TOKENS, fingerprint_digest="fp-a", require_value_digest=True
        )
        assert store.lookup(plain).num_blocks == 3
        assert (store.lookup(checkable).num_blocks, store.lookup(checkable).version) == (2, 8)
        await store.send(_send_body(2), DEST)
        assert sender.digests == [b"digest-of-position-7"]  # it travels with the blocks
        blocks, digest = store.read_local(TOKENS[:8], "fp-a", None, 5.0)
        assert len(blocks) == 2 and digest == b"digest-of-position-7"
        await store.aclose()

    asyncio.run(scenario())
