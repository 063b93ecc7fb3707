"""Sender and receiver over in-memory and fault-injecting streams: bytes land exactly, only a
verified commit counts, retries are idempotent, fatal refusals are not retried, leases fence."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
from collections.abc import Awaitable
from dataclasses import dataclass, field

import pytest
from memory_streams import memory_stream_pair

from pdserve.clock import FakeClock
from pdserve.errors import (
    FingerprintMismatch,
    LeaseExpired,
    PeerClosed,
    TransferRefused,
    TransferTimeout,
)
from pdserve.transfer.backoff import BackoffPolicy
from pdserve.transfer.faulty import Fault, FaultAction, FaultPlan, FaultyStream
from pdserve.transfer.lease import Lease, LeaseTable
from pdserve.transfer.messages import KVLayout, token_digest
from pdserve.transfer.receiver import IncomingTransfer, KVReceiver
from pdserve.transfer.receiver_session import ReceivePlan
from pdserve.transfer.sender import LeaseHandle, OutgoingTransfer, SendPolicy, send_with_retries
from pdserve.transfer.sender_session import SenderSession
from pdserve.transfer.stream import ByteStream

BLOCK_BYTES = 4096
NUM_BLOCKS = 10
FP = {"model": "tiny", "dtype": "float32", "kv_block_size": 16}
FAST = SendPolicy(
    frame_bytes=3 * BLOCK_BYTES, chunk_timeout_s=0.5, backoff=BackoffPolicy(0.001, 0.005, 4)
)


@dataclass
class Pair:
    """A sender's source blocks, a receiver's destination blocks, and the connections."""

    receiver: KVReceiver
    transfer: OutgoingTransfer
    dest: list[bytearray]
    verified: list[str] = field(default_factory=list)
    plans: list[FaultPlan] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def connect(self) -> ByteStream:
        a, b = memory_stream_pair()
        self.tasks.append(asyncio.create_task(self.receiver.handle(b)))
        plan = self.plans.pop(0) if self.plans else FaultPlan()
        return FaultyStream(a, plan)


def make_pair(receiver_fp: dict[str, object] = FP, token: bytes = b"t" * 16) -> Pair:
    rng = random.Random(1)
    src = [bytes(rng.randbytes(BLOCK_BYTES)) for _ in range(NUM_BLOCKS)]
    layout = KVLayout(2, NUM_BLOCKS, BLOCK_BYTES, "float32", 16)
    tid = os.urandom(16)
    digest = token_digest(list(range(150)))
    transfer = OutgoingTransfer(
        tid, "req-1", 1, layout, 150, digest, token, [memoryview(s) for s in src]
    )
    receiver = KVReceiver(receiver_fp)  # type: ignore[arg-type]
    dest = [bytearray(BLOCK_BYTES) for _ in range(NUM_BLOCKS)]
    pair = Pair(receiver, transfer, dest)
    plan = ReceivePlan(tid, b"t" * 16, layout, "req-1", 150, digest)
    receiver.expect(
        IncomingTransfer(plan, [memoryview(d) for d in dest], lambda: pair.verified.append("ok"))
    )
    return pair


async def send(pair: Pair, **kw: object) -> object:
    session = SenderSession(pair.transfer.transfer_id, FP)
    try:
        return await send_with_retries(
            pair.connect, session, pair.transfer, FAST, deadline=1e12, **kw
        )  # type: ignore[arg-type]
    finally:
        for t in pair.tasks:
            t.cancel()
        await asyncio.gather(*pair.tasks, return_exceptions=True)
        pair.tasks.clear()


def landed(pair: Pair) -> bool:
    return [bytes(d) for d in pair.dest] == [bytes(v) for v in pair.transfer.blocks]


def run(coro: Awaitable[object]) -> object:
    async def bounded() -> object:
        async with asyncio.timeout(20):
            return await coro

    return asyncio.run(bounded())  # type: ignore[arg-type]


def test_clean_transfer_lands_every_byte_and_verifies_once() -> None:
    pair = make_pair()
    report = run(send(pair))
    assert landed(pair)
    assert pair.verified == ["ok"]
    assert report.attempts == 1 and report.bytes_sent == NUM_BLOCKS * BLOCK_BYTES  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "action", [FaultAction.CORRUPT, FaultAction.TRUNCATE, FaultAction.CLOSE, FaultAction.DROP]
)
def test_a_damaged_attempt_is_discarded_and_the_retry_commits(action: FaultAction) -> None:
    pair = make_pair()
    # Send 3 is the second chunk's frame (hello, begin, chunk 0, chunk 1, ...).
    offset = 72 + 20 if action is FaultAction.CORRUPT else 100
    pair.plans = [FaultPlan(faults=(Fault(action, 3, offset),))]
    report = run(send(pair))
    assert report.attempts == 2, report.failures  # type: ignore[attr-defined]
    assert landed(pair)
    assert pair.verified == ["ok"]  # the damaged attempt never verified


def test_corrupt_payload_is_caught_by_the_chunk_checksum() -> None:
    pair = make_pair()
    # Far into the data of the first chunk: header and body are intact, the payload is not.
    pair.plans = [FaultPlan(faults=(Fault(FaultAction.CORRUPT, 2, 5000),))]
    report = run(send(pair))
    assert "ChecksumMismatch" in report.failures[0] or "CHECKSUM" in report.failures[0]  # type: ignore[attr-defined]
    assert landed(pair) and pair.verified == ["ok"]


def test_a_stalled_link_times_out_per_chunk_then_retries() -> None:
    pair = make_pair()
    pair.plans = [FaultPlan(faults=(Fault(FaultAction.STALL, 2),))]
    report = run(send(pair))
    assert report.attempts == 2  # type: ignore[attr-defined]
    assert "TransferTimeout" in report.failures[0]  # type: ignore[attr-defined]
    assert landed(pair)


def test_retries_are_bounded_and_the_last_error_surfaces() -> None:
    pair = make_pair()
    pair.plans = [FaultPlan(faults=(Fault(FaultAction.STALL, 0),))] * 10
    with pytest.raises(TransferTimeout):
        run(send(pair))
    assert pair.verified == []


def test_fingerprint_mismatch_is_fatal_and_names_the_field() -> None:
    pair = make_pair(receiver_fp={**FP, "dtype": "bfloat16"})
    with pytest.raises(TransferRefused, match="dtype") as info:
        run(send(pair))
    assert not info.value.retryable
    assert pair.verified == [] and not any(any(d) for d in pair.dest)
    incoming = pair.receiver.get(pair.transfer.transfer_id)
    assert incoming is not None and incoming.last_error is not None
    assert incoming.last_error.startswith(FingerprintMismatch.__name__)
    assert "dtype: 'bfloat16' != 'float32'" in incoming.last_error  # local first


def test_wrong_capability_token_gets_no_data_in() -> None:
    pair = make_pair(token=b"x" * 16)
    with pytest.raises(TransferRefused, match="UNAUTHORIZED"):
        run(send(pair))
    assert not any(any(d) for d in pair.dest)
    assert pair.verified == []


def test_unknown_transfer_is_refused() -> None:
    pair = make_pair()
    run(pair.receiver.fence(pair.transfer.transfer_id))
    with pytest.raises(TransferRefused, match="UNKNOWN_TRANSFER"):
        run(send(pair))


def test_a_transfer_reserved_by_a_previous_life_is_refused_as_such() -> None:
    """Restarted at the same address, the decode process knows nothing of the transfer; the
    sender's Hello names the instance the reservation came from, so the refusal says so (not
    retried: that life and its reservation are gone)."""
    pair = make_pair()
    restarted = KVReceiver(FP, instance=bytes.fromhex("b2" * 8))  # type: ignore[arg-type]
    pair.receiver = restarted
    session = SenderSession(pair.transfer.transfer_id, FP, peer_instance=bytes.fromhex("a1" * 8))

    async def go() -> None:
        try:
            await send_with_retries(pair.connect, session, pair.transfer, FAST, deadline=1e12)
        finally:
            for t in pair.tasks:
                t.cancel()
            await asyncio.gather(*pair.tasks, return_exceptions=True)

    with pytest.raises(TransferRefused, match=r"STALE_INSTANCE.*a1a1a1a1a1a1a1a1") as info:
        run(go())
    assert not info.value.retryable
    # The same Hello to the life that made the reservation would have been taken.
    fresh = make_pair()
    fresh.receiver.instance = bytes.fromhex("a1" * 8)
    same = SenderSession(fresh.transfer.transfer_id, FP, peer_instance=bytes.fromhex("a1" * 8))
    report = run(send_with_retries(fresh.connect, same, fresh.transfer, FAST, deadline=1e12))
    assert report.attempts == 1 and landed(fresh)  # type: ignore[attr-defined]


def test_lease_released_on_ack_only_and_fenced_before_each_attempt() -> None:
    clock = FakeClock()
    table = LeaseTable(clock)
    lease = table.grant(list(range(NUM_BLOCKS)), ttl=30.0, holder="decode-1")
    pair = make_pair()
    run(send(pair, lease=LeaseHandle(table, lease.lease_id, lease.epoch)))
    assert table.num_active == 0  # released after the Ack

    expired = table.grant(list(range(NUM_BLOCKS)), ttl=1.0, holder="decode-1")
    clock.advance(2.0)
    pair = make_pair()
    with pytest.raises(LeaseExpired):
        run(send(pair, lease=LeaseHandle(table, expired.lease_id, expired.epoch)))
    assert pair.receiver.num_failed_attempts == 0  # refused before connecting: nothing sent


def test_retry_after_commit_is_idempotent() -> None:
    pair = make_pair()
    run(send(pair))
    again = run(send(pair))  # a sender that missed the Ack sends again
    assert again.bytes_sent == 0  # type: ignore[attr-defined]
    assert pair.verified == ["ok"]


def test_max_attempts_bounds_retries_before_the_deadline() -> None:
    pair = make_pair()
    pair.plans = [FaultPlan(faults=(Fault(FaultAction.CLOSE, 2),))] * 10
    policy = dataclasses.replace(FAST, max_attempts=2)
    session = SenderSession(pair.transfer.transfer_id, FP)

    async def go() -> None:
        try:
            await send_with_retries(pair.connect, session, pair.transfer, policy, deadline=1e12)
        finally:
            for t in pair.tasks:
                t.cancel()

    with pytest.raises(PeerClosed):
        run(go())
    assert len(pair.plans) == 8  # exactly two connections were made
    assert pair.verified == []


def test_every_reply_from_the_receiver_renews_the_senders_lease() -> None:
    clock = FakeClock()
    renewals: list[float] = []

    class Spy(LeaseTable):
        def renew(self, lease_id: int, epoch: int, ttl: float) -> Lease:
            renewals.append(ttl)
            return super().renew(lease_id, epoch, ttl)

    table = Spy(clock)
    lease = table.grant(list(range(NUM_BLOCKS)), ttl=1.0, holder="prefill-1")
    pair = make_pair()
    run(send(pair, lease=LeaseHandle(table, lease.lease_id, lease.epoch, renew_ttl_s=7.0)))
    # Hello, Begin and Commit are each answered once, and each of the 4 chunks (10 blocks in
    # frames of 3) the transport accepted is progress too.
    assert renewals == [7.0] * (3 + 4)
    assert table.num_active == 0 and landed(pair)
