"""A pooled KV connection outlives the hand-over of the transfer it carried.

The decode side fences every transfer when it hands the KV over (`KVInbox.take`). Once the
transfer is committed its session refuses every Chunk, so the connection is no longer its
writer and the fence must leave it open: the prefill side's pool reuses it for the next
transfer instead of paying a new stream (a new shm segment or NIXL agent) per handoff. A fence
before the commit still closes the connection (the writer is cancelled).
"""

from __future__ import annotations

import asyncio
import os

from waiting import until

from pdserve.transfer.framing import read_frame, write_frame
from pdserve.transfer.messages import Begin, KVLayout, token_digest
from pdserve.transfer.receiver import IncomingTransfer, KVReceiver, ReceiverLimits
from pdserve.transfer.receiver_session import ReceivePlan
from pdserve.transfer.sender import OutgoingTransfer, SendPolicy, send_attempt
from pdserve.transfer.sender_session import SenderSession
from pdserve.transfer.tcp import open_tcp_stream, serve_tcp

FP = {"model": "tiny", "dtype": "float32"}
BLOCK_BYTES = 8192
LAYOUT = KVLayout(2, 3, BLOCK_BYTES, "float32", 16)
POLICY = SendPolicy(frame_bytes=5000, chunk_timeout_s=5.0)


def _transfer(receiver: KVReceiver, fill: int) -> tuple[OutgoingTransfer, list[bytearray]]:
    tid, token = os.urandom(16), os.urandom(16)
    digest = token_digest(list(range(40)))
    src = [bytes([fill + i]) * BLOCK_BYTES for i in range(LAYOUT.num_blocks)]
    dest = [bytearray(BLOCK_BYTES) for _ in range(LAYOUT.num_blocks)]
    plan = ReceivePlan(tid, token, LAYOUT, f"r{fill}", 40, digest)
    receiver.expect(IncomingTransfer(plan, [memoryview(d) for d in dest], lambda: None))
    outgoing = OutgoingTransfer(
        tid, f"r{fill}", 1, LAYOUT, 40, digest, token, [memoryview(s) for s in src]
    )
    return outgoing, dest


def test_fencing_a_committed_transfer_keeps_its_connection_for_the_next_one() -> None:
    async def body() -> None:
        receiver = KVReceiver(FP)
        server = await serve_tcp(receiver.handle)
        stream = await open_tcp_stream(server.address)
        try:
            # Each transfer rides the connection the one before was fenced on: a fence that
            # closed it fails the next send_attempt, with no wait for an EOF to show.
            for fill in (1, 100, 200):
                assert stream.reusable()
                outgoing, dest = _transfer(receiver, fill)
                session = SenderSession(outgoing.transfer_id, FP)
                await send_attempt(stream, session, outgoing, POLICY)
                await receiver.fence(outgoing.transfer_id)  # the hand-over
                assert [bytes(d) for d in dest] == [bytes(b) for b in outgoing.blocks]
            assert receiver.num_fenced_writers == 0
        finally:
            await stream.aclose()
            await server.aclose()

    asyncio.run(asyncio.wait_for(body(), 20))


def test_fencing_before_the_commit_still_closes_the_writer() -> None:
    async def body() -> None:
        # Frame deadlines past the test's own: the fence closes it, not a timeout.
        receiver = KVReceiver(FP, limits=ReceiverLimits(frame_timeout_s=60.0))
        server = await serve_tcp(receiver.handle)
        stream = await open_tcp_stream(server.address)
        try:
            outgoing, _ = _transfer(receiver, 1)
            session = SenderSession(outgoing.transfer_id, FP)
            # Hello and Begin only: the connection becomes the writer, nothing is committed.
            await write_frame(stream, session.send_hello())
            session.receive(*await read_frame(stream))
            begin = Begin(
                outgoing.transfer_id, "r1", 1, LAYOUT, 40, outgoing.token_digest,
                outgoing.capability_token, 0,
            )  # fmt: skip
            await write_frame(stream, session.send_begin(begin))
            session.receive(*await read_frame(stream))
            await receiver.fence(outgoing.transfer_id)
            assert receiver.num_fenced_writers == 1
            await until(lambda: not stream.reusable(), what="the receiver closed it")
        finally:
            await stream.aclose()
            await server.aclose()

    asyncio.run(asyncio.wait_for(body(), 20))
