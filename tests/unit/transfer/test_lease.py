"""LeaseTable: grants, expiry on a fake clock, fencing by epoch, and a state-machine test."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
)

from pdserve.clock import FakeClock
from pdserve.errors import LeaseError, LeaseExpired, StaleLease
from pdserve.transfer.lease import Lease, LeaseTable


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=100.0)


@pytest.fixture
def table(clock: FakeClock) -> LeaseTable:
    return LeaseTable(clock)


def test_grant_gives_increasing_epochs_and_a_deadline(table: LeaseTable) -> None:
    a = table.grant([1, 2], ttl=5.0, holder="prefill:req-1")
    b = table.grant([3], ttl=1.5, holder="prefill:req-2")
    assert (a.resource_ids, a.deadline, a.holder) == ((1, 2), 105.0, "prefill:req-1")
    assert b.epoch > a.epoch and b.lease_id != a.lease_id
    assert table.check(a.lease_id, a.epoch) == a
    assert (table.num_active, table.num_resources_held, table.num_granted_total) == (2, 3, 2)
    assert table.lease_of(2) == a and table.lease_of(9) is None
    assert table.next_deadline() == 101.5


def test_a_resource_is_under_at_most_one_lease(table: LeaseTable) -> None:
    table.grant([1, 2], ttl=5.0, holder="a")
    with pytest.raises(LeaseError, match="resource 2"):
        table.grant([2, 3], ttl=5.0, holder="b")
    assert table.lease_of(3) is None  # a refused grant takes nothing
    with pytest.raises(ValueError):
        table.grant([4, 4], ttl=5.0, holder="b")
    for ttl in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            table.grant([5], ttl=ttl, holder="b")


def test_expiry_returns_exactly_the_lapsed_leases(clock: FakeClock, table: LeaseTable) -> None:
    a = table.grant([1, 2], ttl=5.0, holder="a")
    b = table.grant([3], ttl=10.0, holder="b")
    clock.advance(4.999)
    assert table.expire() == []
    clock.advance(0.001)  # now == a.deadline: a lease is live only while now < deadline
    assert table.expire() == [a]
    assert table.expire() == []  # returned once
    assert table.lease_of(1) is None and table.lease_of(3) == b
    assert (table.num_active, table.num_resources_held, table.num_expired_total) == (1, 1, 1)
    c = table.grant([1, 2], ttl=1.0, holder="c")
    assert c.resource_ids == (1, 2)
    assert table.expire(now=10_000.0) == [c, b]  # in deadline order


def test_a_lapsed_lease_is_refused_before_expire_runs(clock: FakeClock, table: LeaseTable) -> None:
    lease = table.grant([1], ttl=2.0, holder="a")
    clock.advance(2.0)
    for op in (
        lambda: table.check(lease.lease_id, lease.epoch),
        lambda: table.renew(lease.lease_id, lease.epoch, 5.0),
        lambda: table.release(lease.lease_id, lease.epoch),
    ):
        with pytest.raises(LeaseExpired):
            op()
    with pytest.raises(LeaseError):  # still held until expire returns it
        table.grant([1], ttl=1.0, holder="b")
    assert table.expire() == [lease]


def test_renew_moves_the_deadline_and_keeps_the_epoch(clock: FakeClock, table: LeaseTable) -> None:
    lease = table.grant([1], ttl=2.0, holder="a")
    clock.advance(1.5)
    renewed = table.renew(lease.lease_id, lease.epoch, 2.0)
    assert (renewed.epoch, renewed.deadline) == (lease.epoch, 103.5)
    clock.advance(1.0)  # past the old deadline
    assert table.expire() == [] and table.next_deadline() == 103.5
    clock.advance(1.0)
    assert table.expire() == [renewed]
    with pytest.raises(LeaseExpired):
        table.renew(lease.lease_id, lease.epoch, 2.0)


def test_renew_may_shorten_a_lease(clock: FakeClock, table: LeaseTable) -> None:
    lease = table.grant([1], ttl=10.0, holder="a")
    table.renew(lease.lease_id, lease.epoch, 1.0)
    assert table.next_deadline() == 101.0
    clock.advance(1.0)
    assert [x.lease_id for x in table.expire()] == [lease.lease_id]
    assert table.next_deadline() is None


def test_release_returns_the_resources_once(table: LeaseTable) -> None:
    lease = table.grant([4, 5], ttl=5.0, holder="a")
    with pytest.raises(StaleLease):
        table.release(lease.lease_id, lease.epoch + 1)
    assert table.lease_of(4) == lease  # a refused release changes nothing
    assert table.release(lease.lease_id, lease.epoch) == (4, 5)
    with pytest.raises(StaleLease, match="released"):
        table.release(lease.lease_id, lease.epoch)
    assert table.num_released_total == 1 and table.next_deadline() is None
    assert table.expire(now=1e9) == []


def test_fencing_after_expiry_and_regrant(clock: FakeClock, table: LeaseTable) -> None:
    old = table.grant([7, 8], ttl=1.0, holder="transfer-1")
    clock.advance(1.0)
    table.expire()
    with pytest.raises(LeaseExpired):
        table.check(old.lease_id, old.epoch)
    new = table.grant([8], ttl=5.0, holder="transfer-2")
    # Block 8 now belongs to a newer epoch: the old grant can never reach it again.
    with pytest.raises(StaleLease, match=f"epoch {new.epoch}"):
        table.check(old.lease_id, old.epoch)
    with pytest.raises(StaleLease):
        table.check(new.lease_id, old.epoch)
    with pytest.raises(LeaseError):
        table.check(999, 1)


def test_epochs_fence_leases_of_an_earlier_incarnation(clock: FakeClock) -> None:
    before = LeaseTable(clock).grant([1], ttl=5.0, holder="a")
    after = LeaseTable(clock, first_epoch=1000)  # a restarted worker reuses lease ids
    current = after.grant([1], ttl=5.0, holder="b")
    assert current.lease_id == before.lease_id and current.epoch == 1000
    with pytest.raises(StaleLease):
        after.check(before.lease_id, before.epoch)


def test_a_bounded_history_still_refuses_old_leases(clock: FakeClock) -> None:
    table = LeaseTable(clock, history=1)
    first = table.grant([1], ttl=1.0, holder="a")
    table.release(first.lease_id, first.epoch)
    second = table.grant([1], ttl=1.0, holder="b")
    table.release(second.lease_id, second.epoch)
    with pytest.raises(LeaseExpired, match="long ago"):
        table.check(first.lease_id, first.epoch)
    with pytest.raises(StaleLease):
        table.check(second.lease_id, second.epoch)


# ---- state machine -----------------------------------------------------------------------------

RESOURCES = st.sets(st.integers(0, 11), max_size=4)
TTLS = st.floats(min_value=0.5, max_value=8.0)


class LeaseMachine(RuleBasedStateMachine):
    """Random grant/renew/release/advance/expire against a model of who holds what."""

    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.table = LeaseTable(self.clock)
        self.live: dict[int, Lease] = {}  # the model: lease id -> current lease
        self.granted: Counter[tuple[int, int]] = Counter()  # (lease id, resource)
        self.returned: Counter[tuple[int, int]] = Counter()

    def _held(self) -> dict[int, int]:
        return {rid: lease.lease_id for lease in self.live.values() for rid in lease.resource_ids}

    def _returned(self, lease_id: int, resource_ids: tuple[int, ...]) -> None:
        for rid in resource_ids:
            self.returned[(lease_id, rid)] += 1

    @rule(target=leases, resource_ids=RESOURCES, ttl=TTLS)
    def grant(self, resource_ids: set[int], ttl: float) -> object:
        if resource_ids & set(self._held()):
            with pytest.raises(LeaseError):
                self.table.grant(sorted(resource_ids), ttl, "h")
            return multiple()
        lease = self.table.grant(sorted(resource_ids), ttl, "h")
        self.live[lease.lease_id] = lease
        for rid in lease.resource_ids:
            self.granted[(lease.lease_id, rid)] += 1
        return lease

    def _usable(self, lease: Lease, epoch: int) -> bool:
        current = self.live.get(lease.lease_id)
        return (
            current is not None and epoch == current.epoch and self.clock.now() < current.deadline
        )

    @rule(lease=leases, ttl=TTLS, stale=st.booleans())
    def renew(self, lease: Lease, ttl: float, stale: bool) -> None:
        epoch = lease.epoch - 1 if stale else lease.epoch
        if self._usable(lease, epoch):
            self.live[lease.lease_id] = self.table.renew(lease.lease_id, epoch, ttl)
        else:
            with pytest.raises(LeaseError):
                self.table.renew(lease.lease_id, epoch, ttl)

    @rule(lease=consumes(leases), stale=st.booleans())
    def release(self, lease: Lease, stale: bool) -> None:
        epoch = lease.epoch + 1 if stale else lease.epoch
        if self._usable(lease, epoch):
            self._returned(lease.lease_id, self.table.release(lease.lease_id, epoch))
            del self.live[lease.lease_id]
        else:
            with pytest.raises(LeaseError):
                self.table.release(lease.lease_id, epoch)

    @rule(seconds=st.floats(min_value=0.0, max_value=5.0))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def expire(self) -> None:
        now = self.clock.now()
        expected = {i for i, lease in self.live.items() if lease.deadline <= now}
        expired = self.table.expire()
        assert {lease.lease_id for lease in expired} == expected
        for lease in expired:
            self._returned(lease.lease_id, lease.resource_ids)
            del self.live[lease.lease_id]

    @invariant()
    def no_resource_in_two_live_leases(self) -> None:
        seen: set[int] = set()
        for lease in self.live.values():
            assert seen.isdisjoint(lease.resource_ids)
            seen.update(lease.resource_ids)
            assert all(self.table.lease_of(rid) == lease for rid in lease.resource_ids)
        assert self.table.num_resources_held == len(seen)
        assert self.table.num_active == len(self.live)

    @invariant()
    def next_deadline_is_the_earliest(self) -> None:
        deadlines = [lease.deadline for lease in self.live.values()]
        assert self.table.next_deadline() == (min(deadlines) if deadlines else None)

    def teardown(self) -> None:
        # Once everything has lapsed, every granted resource came back exactly once.
        for lease in self.table.expire(now=self.clock.now() + 1e6):
            self._returned(lease.lease_id, lease.resource_ids)
        assert self.returned == self.granted
        assert self.table.num_active == 0 and self.table.num_resources_held == 0


LeaseMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_lease_state_machine = LeaseMachine.TestCase
