"""Fuzz the holder's end of a replication link: after a valid handshake, a writer sends any
sequence of Puts (good ones, ones that break the chain, ask for too long a lease, carry bytes
that disagree with their tokens, arrive damaged or forged, or stop in the middle of their data
as the writer dies) and stray bytes.

Whatever the sequence, what the holder holds is exactly the blocks of the Puts it acknowledged,
with the bytes they carried; nothing stays reserved once the link ends; the tier's accounting
holds. Over an in-memory stream pair: no sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

from fuzz_support import fuzz_settings
from hypothesis import event, given, note
from hypothesis import strategies as st
from memory_streams import memory_stream_pair

from pdserve.checkpoint.host_tier import HostTier
from pdserve.engine.block_manager import hash_block_tokens
from pdserve.errors import PdserveError
from pdserve.transfer.codec import data_checksum, encode
from pdserve.transfer.framing import read_frame
from pdserve.transfer.link_session import LinkWriter
from pdserve.transfer.messages import Ack, Hello, Put
from pdserve.transfer.receiver import KVReceiver, ReceiverLimits
from pdserve.transfer.session import Outbound
from pdserve.worker.checkpoint.link_server import LinkServer
from pdserve.worker.checkpoint.store import CheckpointStore
from pdserve.worker.engine_loop import EngineInfo

BS = 2
BLOCK_BYTES = 64
INFO = EngineInfo({"model": "m"}, "fp-a", 1, BS, BLOCK_BYTES, "f32", 64, 1024)
KEY = b"k" * 32
TOKENS = list(range(1, 1 + 8 * BS))

# (kind, block index, number of blocks)
actions = st.lists(
    st.tuples(
        st.sampled_from(
            ["good", "good", "chain", "lease", "size", "damage", "forge", "junk", "cut"]
        ),
        st.integers(0, 5),
        st.integers(1, 2),
    ),
    max_size=12,
)


def _parent(i: int) -> int:
    h = 0
    for j in range(i):
        h = hash_block_tokens(h, TOKENS[j * BS : (j + 1) * BS])
    return h


def _data(i: int, n: int, salt: int) -> bytes:
    return b"".join(bytes([(i + k + salt) % 251 + 1]) * BLOCK_BYTES for k in range(n))


@fuzz_settings(120)
@given(actions, st.integers(0, 200))
def test_a_holder_holds_exactly_what_it_acknowledged(
    script: list[tuple[str, int, int]], salt: int
) -> None:
    async def main() -> None:
        tier = HostTier(6 * BLOCK_BYTES, BS, BLOCK_BYTES)  # room for six: "full" happens too
        limits = ReceiverLimits(frame_timeout_s=1.0, idle_timeout_s=1.0)
        receiver = KVReceiver(INFO.fingerprint, cluster_key=KEY, limits=limits)
        store = CheckpointStore(tier, INFO, receiver, list, None)  # type: ignore[arg-type]
        server = LinkServer(store, INFO, KEY, limits)
        a, b = memory_stream_pair()
        writer = LinkWriter(INFO.fingerprint, KEY)
        opening = writer.hello()
        await a.send(encode(opening.message, envelope=opening.envelope))
        header, hello = await read_frame(b)
        assert isinstance(hello, Hello)

        async def serve() -> None:
            try:
                await server.serve(b, header, hello, "memory")
            finally:  # as the receiver's connection handler does
                await b.aclose()

        serving = asyncio.create_task(serve())
        reply_header, reply = await read_frame(a)
        writer.receive_hello(reply_header, reply)
        held: dict[int, bytes] = {}  # block hash -> bytes, for every acknowledged Put
        next_block = 0  # a "good" Put continues the chain the holder acknowledged so far
        try:
            for kind, i, n in script:
                if kind == "good":
                    i = min(next_block, 7)
                n = min(n, 8 - i)
                tokens = tuple(TOKENS[i * BS : (i + n) * BS])
                data = _data(i, n, salt)
                put = Put("req", _parent(i), (i + 1) * BS, tokens, 30.0)
                if kind == "chain":
                    put = replace(put, parent_hash=_parent(i) ^ 1)
                elif kind == "lease":
                    put = replace(put, lease_ttl=1e9)
                elif kind == "size":
                    data = data + bytes(BLOCK_BYTES)
                if kind == "junk":
                    await a.send([b"\x00garbage" * 9])
                    break
                out = writer.put(put, data_checksum([data]))
                if kind == "forge":  # changed after signing: the MAC no longer covers it
                    assert isinstance(out.message, Put)
                    out = Outbound(out.envelope, replace(out.message, owner="other"))
                parts = encode(out.message, data, envelope=out.envelope)
                if kind == "damage":  # a flipped data byte after the header was built
                    parts[-1] = bytes([parts[-1][0] ^ 1]) + bytes(parts[-1][1:])
                if kind == "cut":  # the writer dies in the middle of the Put's data
                    await a.send([*parts[:-1], bytes(parts[-1])[: BLOCK_BYTES // 2]])
                    break
                await a.send(parts)
                try:
                    async with asyncio.timeout(2.0):
                        rh, message = await read_frame(a)
                except (PdserveError, TimeoutError):
                    break  # the holder closed the link (forged Put)
                with contextlib.suppress(PdserveError):
                    writer.receive_reply(rh, message)
                if isinstance(message, Ack):
                    next_block = max(next_block, i + n)
                    h = _parent(i)
                    for k in range(n):
                        h = hash_block_tokens(h, list(tokens[k * BS : (k + 1) * BS]))
                        held[h] = data[k * BLOCK_BYTES : (k + 1) * BLOCK_BYTES]
                if writer.state.name == "FAILED":
                    break
        finally:
            await a.aclose()
            async with asyncio.timeout(5):
                await serving
        assert tier.reserved_bytes == 0
        tier.check_invariants()
        note(f"held {len(held)} blocks; puts by result {dict(server.puts)}")
        event(f"held blocks: {min(len(held), 3)}+")
        # Exactly the acknowledged blocks, with their bytes: an ack never lies, and nothing
        # else got in (a block's bytes depend only on its index, so a repeat carries the same).
        assert set(tier._entries) == set(held)
        for h, entry in tier._entries.items():
            assert bytes(entry.data) == held[h]

    asyncio.run(asyncio.wait_for(main(), 30))
