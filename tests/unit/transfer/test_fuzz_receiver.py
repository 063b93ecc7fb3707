"""Fuzz: the real `KVReceiver.handle` over in-memory stream pairs, with reservations registered
and leased as the decode worker registers them, against damaged and concurrent senders.

Set-up, as `worker/kv/inbox.py` wires it: two reservations (A: lease TTL 1 s, B: 50 s) from a
`LeaseKeeper` on a `FakeClock`, each an `IncomingTransfer` whose guard checks its lease and
whose progress renews it, landing into blocks of one arena (guard bytes between blocks). A
reservation's blocks are freed only after `KVReceiver.fence` returned, then overwritten at once
(they now belong to another request).

What is fuzzed: 1 to 3 connections (`memory_stream_pair`, no buffering), each sending a valid
sender script for A or B (attempt 1 to 3) after frame-level, structure-aware and byte-level
damage (`wire_fuzz.damaged_stream`), cut into random pieces and started at random points; one
sender may pause after one of its pieces while the fake clock jumps past A's lease (or both)
and the lease reaper runs, then resume.

Properties: every connection's handler ends within the bound (no hang) by returning, a typed
`PdserveError`, or being fenced; everything the receiver wrote back decodes; a transfer verified
holds exactly its sender's payload; after every reservation is handed over or cancelled no lease,
leased block or expected transfer is left and every block is back in the pool; no byte is written
into a block after its lease ended nor outside a reservation's blocks.

Budget: 150 examples, fixed seed (`fuzz_support`): about 1 s of CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from frame_decoder import FrameDecoder
from fuzz_support import fuzz_settings, note
from hypothesis import example, given
from hypothesis import strategies as st
from memory_streams import MemoryStream, memory_stream_pair
from wire_fuzz import (
    BLOCK_BYTES,
    FP,
    KEY,
    NUM_BLOCKS,
    TransferSpec,
    damaged_stream,
    make_spec,
    split_at,
)
from wire_fuzz import script as sender_script

from pdserve.clock import FakeClock
from pdserve.errors import FrameTruncated, PdserveError
from pdserve.transfer.receiver import IncomingTransfer, KVReceiver, ReceiverLimits
from pdserve.transfer.receiver_session import ReceivePlan
from pdserve.transfer.sender import LeaseHandle
from pdserve.worker.lease_keeper import LeaseKeeper

# Lease epochs start at 1 and A is granted first: the specs name the epochs they will get.
SPECS = (make_spec(0, epoch=1), make_spec(1, epoch=2))
TTLS = (1.0, 50.0)
GUARD = 8  # bytes between blocks in the arena, never part of a block
POISON = 0xEE  # what a block's next owner writes into it
NUM_ARENA_BLOCKS = NUM_BLOCKS * len(SPECS)
# Generous: the senders always close, so a deadline firing here would mean a hang.
LIMITS = ReceiverLimits(handshake_timeout_s=30.0, frame_timeout_s=30.0, idle_timeout_s=30.0)
EXAMPLE_TIMEOUT_S = 20.0
# Event-loop turns a receiver gets to act on the last bytes before its peer closes.
QUIESCE_TURNS = 30


def block_offset(block_id: int) -> int:
    return GUARD + block_id * (BLOCK_BYTES + GUARD)


@dataclass
class Reservation:
    """One reservation of the decode side: its lease, blocks and fate."""

    spec: TransferSpec
    lease: LeaseHandle
    block_ids: list[int]
    num_verified: int = 0
    cancelled: bool = False


@dataclass
class Owner:
    """The decode worker's side: leases, the receiver, the block pool and its arena."""

    clock: FakeClock = field(default_factory=FakeClock)
    arena: bytearray = field(default_factory=lambda: bytearray(block_offset(NUM_ARENA_BLOCKS)))
    free: set[int] = field(default_factory=lambda: set(range(NUM_ARENA_BLOCKS)))
    # Blocks reused by another request after their lease ended (must keep POISON).
    reused: set[int] = field(default_factory=set)
    reservations: list[Reservation] = field(default_factory=list)
    cancels: list[asyncio.Task[None]] = field(default_factory=list)
    keeper: LeaseKeeper = field(init=False)
    receiver: KVReceiver = field(init=False)

    def __post_init__(self) -> None:
        self.keeper = LeaseKeeper(clock=self.clock)
        self.receiver = KVReceiver(FP, cluster_key=KEY, limits=LIMITS)

    def views(self, block_ids: list[int]) -> list[memoryview]:
        arena = memoryview(self.arena)
        return [arena[block_offset(b) : block_offset(b) + BLOCK_BYTES] for b in block_ids]

    def reserve(self, spec: TransferSpec, ttl_s: float, block_ids: list[int]) -> Reservation:
        self.free -= set(block_ids)
        made: list[Reservation] = []  # the expiry callback needs the reservation it ends
        holder = f"reservation {spec.request_id}"
        lease = self.keeper.grant(block_ids, ttl_s, holder, lambda: self.spawn_cancel(made[0]))
        res = Reservation(spec, lease, block_ids)
        made.append(res)
        assert lease.epoch == spec.epoch
        plan = ReceivePlan(
            spec.transfer_id,
            spec.token,
            spec.layout,
            spec.request_id,
            spec.num_tokens,
            spec.token_digest,
            epoch=lease.epoch,
        )
        self.receiver.expect(
            IncomingTransfer(
                plan,
                self.views(block_ids),
                on_verified=lambda: setattr(res, "num_verified", res.num_verified + 1),
                guard=lambda: self.keeper.check(lease),
                on_progress=lease.heartbeat,
            )
        )
        self.reservations.append(res)
        return res

    def spawn_cancel(self, res: Reservation) -> None:
        self.cancels.append(asyncio.get_running_loop().create_task(self.cancel(res)))

    async def cancel(self, res: Reservation) -> None:
        """Fence the writer, end the lease, hand the blocks to another request (poisoned)."""
        if res.cancelled:
            return
        res.cancelled = True
        await self.receiver.fence(res.spec.transfer_id)
        self.keeper.drop(res.lease)
        for view in self.views(res.block_ids):
            view[:] = bytes([POISON]) * BLOCK_BYTES
        self.reused |= set(res.block_ids)

    async def settle(self) -> None:
        """Hand over what verified, cancel the rest (as `take` and `cancel` do), free blocks."""
        await asyncio.gather(*self.cancels)
        for res in self.reservations:
            if res.cancelled:
                continue
            if res.num_verified:
                await self.receiver.fence(res.spec.transfer_id)
                self.keeper.drop(res.lease)
                landed = b"".join(bytes(v) for v in self.views(res.block_ids))
                assert landed == res.spec.payload  # verified means exactly the payload
                note("verified and handed over")
            else:
                await self.cancel(res)
        for block_id in self.reused:
            start = block_offset(block_id)
            assert self.arena[start : start + BLOCK_BYTES] == bytes([POISON]) * BLOCK_BYTES
        for res in self.reservations:
            self.free |= set(res.block_ids)


@dataclass(frozen=True)
class Connection:
    """One sender connection: the bytes it sends, how they are cut, when it starts."""

    raw: bytes
    cuts: list[int]
    start_turn: int


@st.composite
def connections(draw: st.DrawFn) -> Connection:
    spec = draw(st.sampled_from(SPECS))
    frames = sender_script(spec, attempt=draw(st.integers(1, 3)))
    return Connection(
        draw(damaged_stream(frames)),
        draw(st.lists(st.integers(0, 1000), max_size=6)),
        draw(st.integers(0, 60)),
    )


async def serve(receiver: KVReceiver, stream: MemoryStream) -> None:
    """What the transport's server does for each connection: handle it, then close it."""
    try:
        await receiver.handle(stream, "tcp")
    finally:
        await stream.aclose()


async def read_replies(stream: MemoryStream) -> bytes:
    replies = bytearray()
    with contextlib.suppress(PdserveError):  # StreamBroken once the sender closes its end
        while chunk := await stream.receive_some():
            replies += chunk
    return bytes(replies)


async def run_connection(owner: Owner, conn: Connection, jump: Jump | None = None) -> None:
    """Send `conn`'s pieces; with `jump`, the clock jumps (the reaper runs) once `jump.at_byte`
    bytes are sent, as if this sender paused there past its lease, then it resumes."""
    for _ in range(conn.start_turn):
        await asyncio.sleep(0)
    ours, theirs = memory_stream_pair(capacity_bytes=0)
    server = asyncio.create_task(serve(owner.receiver, theirs))
    reader = asyncio.create_task(read_replies(ours))
    with contextlib.suppress(PdserveError):  # the receiver may close first (PeerClosed)
        num_sent = 0
        cuts = [*conn.cuts, jump.at_byte] if jump else conn.cuts
        for piece in split_at(conn.raw, cuts):
            await ours.send([piece])
            num_sent += len(piece)
            if jump is not None and num_sent == jump.at_byte:
                owner.clock.advance(jump.seconds)
                owner.keeper.reap()
    for _ in range(QUIESCE_TURNS):
        await asyncio.sleep(0)
    await ours.aclose()
    await asyncio.wait({server})
    if server.cancelled():
        note("handler fenced")
    else:
        exc = server.exception()
        assert exc is None or isinstance(exc, PdserveError), repr(exc)
        note(f"handler ended: {type(exc).__name__ if exc else 'returned'}")
    decoder = FrameDecoder()
    decoder.feed(await reader)  # every reply is a valid frame (or was cut by our close)
    try:
        decoder.feed_eof()
    except FrameTruncated:
        note("a reply was cut by the close")


@dataclass(frozen=True)
class Jump:
    """The fake clock jumps `seconds` (A's lease lapses; at 100 s B's too) while connection
    `connection` is paused after sending `at_byte` bytes."""

    connection: int
    at_byte: int
    seconds: float


async def run_example(conns: list[Connection], jump: Jump | None) -> None:
    owner = Owner()
    for index, (spec, ttl_s) in enumerate(zip(SPECS, TTLS, strict=True)):
        owner.reserve(spec, ttl_s, list(range(index, NUM_ARENA_BLOCKS, len(SPECS))))
    async with asyncio.timeout(EXAMPLE_TIMEOUT_S):
        await asyncio.gather(
            *(
                run_connection(owner, conn, jump if jump and jump.connection == i else None)
                for i, conn in enumerate(conns)
            )
        )
        await owner.settle()
    assert owner.keeper.num_active == 0
    assert owner.keeper.table.num_resources_held == 0
    assert owner.receiver.num_expected == 0
    assert owner.free == set(range(NUM_ARENA_BLOCKS))
    for block_id in range(NUM_ARENA_BLOCKS + 1):  # the guard bytes before every block
        start = block_offset(block_id) - GUARD
        assert owner.arena[start : start + GUARD] == bytes(GUARD)
    for res in owner.reservations:
        assert res.num_verified <= 1
    for reason in owner.receiver.failed_attempts_by_reason:
        note(f"an attempt failed: {reason}")


# A clean sender for A that pauses in the middle of its first chunk's data past A's lease.
_A_SCRIPT = sender_script(SPECS[0])
MID_CHUNK = sum(len(f) for f in _A_SCRIPT[:3]) - 40
PAUSED_MID_CHUNK = Connection(b"".join(_A_SCRIPT), [], 0)
jumps = st.one_of(
    st.none(),
    st.builds(Jump, st.integers(0, 2), st.integers(1, 1000), st.sampled_from([2.0, 100.0])),
)


@fuzz_settings(150)
@given(st.lists(connections(), min_size=1, max_size=3), jumps)
@example([PAUSED_MID_CHUNK], Jump(0, MID_CHUNK, 2.0))
def test_the_receiver_survives_damaged_concurrent_senders_and_leaks_nothing(
    conns: list[Connection], jump: Jump | None
) -> None:
    asyncio.run(run_example(conns, jump))


def test_an_undamaged_script_verifies_through_the_harness() -> None:
    """The harness itself: a clean sender verifies A (so the properties above bite)."""

    async def body() -> None:
        owner = Owner()
        a = owner.reserve(SPECS[0], TTLS[0], [0, 2, 4])
        await run_connection(owner, Connection(b"".join(sender_script(SPECS[0])), [], 0))
        assert a.num_verified == 1
        await owner.settle()
        assert owner.keeper.num_active == 0 and not owner.reused

    asyncio.run(body())
