"""The holder's end of checkpoint replication links: Puts land in its host tier.

A decode worker keeps one link per holder (`checkpoint_link.py`) and sends each checkpoint put
as one frame on it. Here, for each connection whose first frame is a link's Hello:

    Hello ──► LinkHolder.accept (MAC, version, fingerprint; a refusal is counted and answered)
    each Put ──► check (sequence, MAC) ──► store.begin_put (room, chain, version; owner
                 leased) ──► the data lands in the put's own buffers, hashed as it lands
             ──► store.finish_put (held if verified and the owner is still leased) ──► Ack
    refused put (full, chain, version, checksum, owner released) ──► Nack, the link goes on
    bad MAC, bad sequence, silence past the idle timeout, anything unparsable ──► closed

No write after the lease: a put's bytes land only in buffers `begin_put` allocated for it,
which no other owner can see until `finish_put` commits them, and it commits only while the
owner's lease holds. A writer paused past its lease finds its owner released and its chain gone.

It knows the link session, frames and the checkpoint store; not HTTP or the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

from pdserve.checkpoint.holder import Refusal
from pdserve.errors import CheckpointRefused, FingerprintMismatch, PdserveError
from pdserve.protocol.worker_api import MAX_LEASE_TTL_S
from pdserve.transfer.codec import FrameHeader
from pdserve.transfer.framing import discard_data, read_data_into, read_frame, write_frame
from pdserve.transfer.link_session import LinkHolder
from pdserve.transfer.messages import Hello, NackCode, Put, Role
from pdserve.transfer.receiver import ReceiverLimits
from pdserve.transfer.session import Outbound
from pdserve.transfer.stream import ByteStream
from pdserve.worker.checkpoint.store import CheckpointStore
from pdserve.worker.engine_loop import EngineInfo


class LinkServer:
    """Serves the checkpoint links arriving at one holder."""

    def __init__(
        self,
        store: CheckpointStore,
        info: EngineInfo,
        cluster_key: bytes | None,
        limits: ReceiverLimits,
    ) -> None:
        self._store = store
        self._info = info
        self._key = cluster_key
        self._limits = limits
        self.num_links = 0
        # Puts received over links, by result ("held", or the refusal's reason).
        self.puts: Counter[str] = Counter()

    async def serve(
        self, stream: ByteStream, header: FrameHeader, hello: Hello, transport: str
    ) -> None:
        """Serve one link from its Hello to its end (`KVReceiver.link_handler`)."""
        del transport  # links run over whatever carried the Hello; only TCP opens them today
        session = LinkHolder(self._info.fingerprint, self._key, Role.DECODE)
        reply, error = session.accept(header, hello)
        with contextlib.suppress(PdserveError, TimeoutError):
            await self._write(stream, reply)
        if error is not None:
            if isinstance(error, FingerprintMismatch):
                self._store.tier.refused[Refusal.FINGERPRINT.value] += 1
            return
        self.num_links += 1
        with contextlib.suppress(PdserveError, TimeoutError):
            while True:
                async with asyncio.timeout(self._limits.idle_timeout_s):
                    header, message = await read_frame(stream)
                if not isinstance(message, Put):
                    return
                session.check_put(header, message)  # raises: the link is not to be trusted
                await self._write(stream, await self._put(stream, session, header, message))

    async def _put(
        self, stream: ByteStream, session: LinkHolder, header: FrameHeader, put: Put
    ) -> Outbound:
        """Land one Put's data and say how it went (the data is read in every case)."""
        bs, block_bytes = self._info.block_size, self._info.block_bytes
        tokens = list(put.token_ids)
        num_blocks = len(tokens) // bs
        if put.lease_ttl > MAX_LEASE_TTL_S:
            # The HTTP path bounds it the same way: no writer pins a holder's memory for long.
            await self._discard(stream, header.data_len)
            self.puts["lease"] += 1
            text = f"Put of {put.owner}: lease_ttl {put.lease_ttl}s exceeds {MAX_LEASE_TTL_S}s"
            return session.nack(NackCode.CHECKPOINT_REFUSED, text)
        if len(tokens) % bs or header.data_len != num_blocks * block_bytes:
            await self._discard(stream, header.data_len)
            self._store.tier.refused[Refusal.VERSION.value] += 1
            self.puts[Refusal.VERSION.value] += 1
            text = (
                f"Put of {put.owner}: {len(tokens)} tokens and {header.data_len} bytes are not"
                f" whole blocks of {bs} tokens and {block_bytes} bytes"
            )
            return session.nack(NackCode.CHECKPOINT_REFUSED, text)
        block_tokens = [tokens[i * bs : (i + 1) * bs] for i in range(num_blocks)]
        try:
            pending = self._store.begin_put(
                put.owner, put.parent_hash, put.first_version, block_tokens, put.lease_ttl
            )
        except CheckpointRefused as exc:
            await self._discard(stream, header.data_len)
            self.puts[exc.reason] += 1
            return session.nack(NackCode.CHECKPOINT_REFUSED, str(exc))
        verified = False
        try:
            timeout_s = self._limits.frame_timeout_s
            digest = await read_data_into(stream, pending.buffers, timeout_s)
            verified = digest == header.data_checksum
        finally:
            held = self._store.finish_put(pending, verified, put.value_digest)
        if held:
            self.puts["held"] += 1
            return session.ack()
        if not verified:
            self._store.tier.refused[Refusal.CHECKSUM.value] += 1
            self.puts[Refusal.CHECKSUM.value] += 1
            return session.nack(NackCode.CHECKSUM_MISMATCH, f"Put of {put.owner}: data checksum")
        self.puts["released"] += 1
        text = f"Put of {put.owner}: the owner was released while its bytes arrived"
        return session.nack(NackCode.CHECKPOINT_REFUSED, text)

    async def _write(self, stream: ByteStream, out: Outbound) -> None:
        async with asyncio.timeout(self._limits.frame_timeout_s):
            await write_frame(stream, out)

    async def _discard(self, stream: ByteStream, num_bytes: int) -> None:
        async with asyncio.timeout(self._limits.frame_timeout_s):
            await discard_data(stream, num_bytes)
