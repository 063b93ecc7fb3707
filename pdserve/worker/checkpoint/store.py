"""The holder side of decode checkpoints: a worker's host tier, filled and read over KV transfers.

Life cycle of one put (all on the event loop's thread):

    /checkpoint/put ──► tier.begin_put (room, chain and version checked; buffers reserved)
        │               receiver expects the transfer into those buffers
        ├── verified (checksums, fingerprint, token digest) ──► tier.commit: held for the owner
        └── not verified within `put_timeout_s` ──► writer fenced, tier.abort: room back

Every owner (a decoding request) holds its blocks under a lease: /checkpoint/put and
/checkpoint/renew extend it by its TTL, /checkpoint/release ends it, and the reaper releases
owners whose lease lapsed (the decode worker died or was paused). A block is dropped once no
owner holds it, so one TTL after the last writer went silent nothing is held for it.

A pull (/checkpoint/send) reads the longest held prefix of the asked tokens (version,
fingerprint and checksum checked per block; a bad block is refused and counted) and sends
copies of it to a reservation the cluster signed, exactly as a prefill worker sends a handoff.

It knows the tier, the KV receiver and the block sender; not HTTP, not the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence

from pdserve.checkpoint.holder import BlockRun, Refusal
from pdserve.checkpoint.host_tier import HostPut, HostTier
from pdserve.engine.block_manager import prefix_block_hashes
from pdserve.errors import CheckpointRefused, PdserveError
from pdserve.protocol.checkpoint_api import (
    CheckpointFound,
    CheckpointLookup,
    CheckpointPut,
    CheckpointReleased,
    CheckpointRenewed,
    CheckpointSend,
    CheckpointSent,
)
from pdserve.protocol.worker_api import KVEndpoint, Reservation
from pdserve.transfer.messages import token_digest
from pdserve.transfer.receiver import IncomingTransfer, KVReceiver
from pdserve.transfer.receiver_session import ReceivePlan
from pdserve.worker.checkpoint.sender import BlockSender, put_request_id
from pdserve.worker.engine_loop import EngineInfo
from pdserve.worker.kv.outbox import Destination, layout_of

# The receiving side names no lease epoch for an import, a put or a pull (their lease is the
# owner's or the resume's, not a block's).
_IMPORT_EPOCH = 0


def import_plan(
    info: EngineInfo, request_id: str, tokens: Sequence[int], num_blocks: int
) -> ReceivePlan:
    """The receive plan of `num_blocks` blocks holding `tokens`, under fresh random ids."""
    return ReceivePlan(
        os.urandom(16),
        os.urandom(16),
        layout_of(info, num_blocks),
        request_id,
        len(tokens),
        token_digest(tokens),
        epoch=_IMPORT_EPOCH,
    )


def import_reservation(
    plan: ReceivePlan, receiver: KVReceiver, endpoints: list[KVEndpoint], lease_ttl_s: float
) -> Reservation:
    """The reservation a sender is given to send `plan`'s blocks to `receiver`."""
    return Reservation(
        request_id=plan.request_id or "",
        transfer_id=plan.transfer_id.hex(),
        capability_token=plan.capability_token.hex(),
        endpoints=endpoints,
        lease_epoch=_IMPORT_EPOCH,
        num_cached_tokens=0,
        lease_ttl_s=lease_ttl_s,
        instance_id=receiver.instance.hex(),
    )


def check_fingerprint(info: EngineInfo, digest: str, where: str, refused: Counter[str]) -> None:
    """Refuse (and count in `refused`) KV of an engine whose fingerprint is not this one's."""
    if digest != info.fingerprint_digest:
        refused[Refusal.FINGERPRINT.value] += 1
        raise CheckpointRefused(
            Refusal.FINGERPRINT.value,
            f"{where}: fingerprint {digest}, this worker's engine is {info.fingerprint_digest}",
        )


class CheckpointStore:
    """One worker's checkpoint holder: its tier, owner leases and pending puts."""

    def __init__(
        self,
        tier: HostTier,
        info: EngineInfo,
        receiver: KVReceiver,
        endpoints: Callable[[], list[KVEndpoint]],
        sender: BlockSender,
        *,
        put_timeout_s: float = 10.0,
        reap_interval_s: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tier = tier
        self._info = info
        self._receiver = receiver
        self._endpoints = endpoints
        self._sender = sender
        self._put_timeout_s = put_timeout_s
        self._reap_interval_s = reap_interval_s
        self._clock = clock
        # Owner -> monotonic second its lease lapses.
        self._leases: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self.num_lease_expiries = 0
        self.num_blocks_sent = 0
        self.num_bytes_sent = 0
        self.send_failures: Counter[str] = Counter()
        # Names this holder in lookups, so a worker resuming on itself reads in process.
        self.holder_id = os.urandom(8).hex()

    def start(self) -> None:
        """Start the reaper of lapsed owner leases."""
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def aclose(self) -> None:
        """Stop the reaper and pending puts; drop everything held."""
        tasks = [*self._tasks, *([self._reaper] if self._reaper else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        for owner in list(self._leases):
            self.tier.release(owner)
        self._leases.clear()

    # ---- puts (decode worker -> here) ----------------------------------------------------

    def _check_fingerprint(self, digest: str, where: str) -> None:
        check_fingerprint(self._info, digest, where, self.tier.refused)

    def put(self, body: CheckpointPut) -> Reservation:
        """Reserve room for the blocks and expect their transfer; CheckpointRefused (full,
        chain, version, fingerprint) before any byte travels."""
        self._check_fingerprint(body.fingerprint_digest, f"checkpoint put of {body.owner}")
        pending = self.begin_put(
            body.owner, body.parent_hash, body.first_version, body.block_tokens, body.lease_ttl_s
        )
        info = self._info
        tokens = [t for block in body.block_tokens for t in block]
        plan = import_plan(
            info, put_request_id(body.owner, body.first_version), tokens, len(pending.keys)
        )
        verified = asyncio.Event()
        incoming = IncomingTransfer(plan, pending.buffers, verified.set)
        try:
            self._receiver.expect(incoming)
        except BaseException:
            self.tier.abort(pending)
            raise
        self._spawn(self._settle_put(incoming, pending, verified))
        return import_reservation(plan, self._receiver, self._endpoints(), body.lease_ttl_s)

    async def _settle_put(
        self, incoming: IncomingTransfer, pending: HostPut, verified: asyncio.Event
    ) -> None:
        """Commit the put once verified, or give its room back after the timeout; either way
        its writer is fenced first."""
        ok = False
        try:
            async with asyncio.timeout(self._put_timeout_s):
                await verified.wait()
            ok = True
        except TimeoutError:
            pass
        finally:
            try:
                await asyncio.shield(self._receiver.fence(incoming.plan.transfer_id))
            except BaseException:
                ok = False  # the fence not confirmed (the store closing): nothing is held
                raise
            finally:
                # Even when cancelled: the room goes back, and nothing unfenced is held.
                # The writer's value digest of the put's last position came in its Commit.
                session = incoming.session
                digest = session.value_digest if session is not None else b""
                self.finish_put(pending, ok, digest)

    def begin_put(
        self,
        owner: str,
        parent_hash: int,
        first_version: int,
        block_tokens: list[list[int]],
        lease_ttl_s: float,
    ) -> HostPut:
        """Room for a put of this engine's fingerprint (checked by the caller: `put`, or a
        link's handshake), the owner leased; CheckpointRefused (full, chain, version)."""
        fingerprint = self._info.fingerprint_digest
        run = BlockRun(owner, fingerprint, parent_hash, first_version, block_tokens)
        pending = self.tier.begin_put(run)
        self._lease(owner, lease_ttl_s)
        return pending

    def finish_put(self, pending: HostPut, verified: bool, value_digest: bytes) -> bool:
        """Hold a put's blocks if its bytes were verified and its owner is still leased (not
        released while they flew), else give its room back; True when held."""
        if verified and pending.owner in self._leases:
            self.tier.commit(pending, value_digest)
            return True
        self.tier.abort(pending)
        return False

    # ---- owner leases --------------------------------------------------------------------

    def _lease(self, owner: str, ttl_s: float) -> None:
        self._leases[owner] = self._clock() + ttl_s

    def renew(self, owner: str, ttl_s: float) -> CheckpointRenewed:
        """Extend the owner's lease (a new one if it had lapsed: it holds nothing then)."""
        self._lease(owner, ttl_s)
        return CheckpointRenewed(owner=owner, lease_ttl_s=ttl_s, num_blocks=self.tier.owned(owner))

    def release(self, owner: str) -> CheckpointReleased:
        """The owner's request ended: drop what only it held (idempotent)."""
        self._leases.pop(owner, None)
        return CheckpointReleased(owner=owner, num_freed_blocks=self.tier.release(owner))

    def reap(self) -> int:
        """Release every owner whose lease lapsed; returns how many."""
        now = self._clock()
        lapsed = [owner for owner, until in self._leases.items() if until <= now]
        for owner in lapsed:
            self.release(owner)
        self.num_lease_expiries += len(lapsed)
        return len(lapsed)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self._reap_interval_s)
            self.reap()

    # ---- pulls (a resuming worker -> here) -----------------------------------------------

    def lookup(self, body: CheckpointLookup) -> CheckpointFound:
        """The longest held prefix of the tokens' full blocks."""
        self._check_fingerprint(body.fingerprint_digest, "checkpoint lookup")
        hashes = prefix_block_hashes(body.token_ids, self._info.block_size)
        n = self.tier.longest_prefix(hashes, body.fingerprint_digest).num_blocks
        if body.require_value_digest:
            # A prefix the reader can check by value: it ends with a block that has a digest.
            while n and not self.tier.value_digest(hashes[n - 1]):
                n -= 1
        return CheckpointFound(
            num_blocks=n, version=n * self._info.block_size, holder_id=self.holder_id
        )

    def read_local(
        self,
        token_ids: list[int],
        fingerprint: str,
        adopt_owner: str | None,
        lease_ttl_s: float,
    ) -> tuple[list[memoryview], bytes]:
        """The held blocks of `token_ids` (whole blocks, each checked) and the value digest of
        the last, for a request resuming on this worker: no transfer. CheckpointRefused names
        a missing or bad block."""
        hashes = prefix_block_hashes(token_ids, self._info.block_size)
        blocks = self.tier.read(hashes, fingerprint)
        if adopt_owner is not None:
            self._lease(adopt_owner, lease_ttl_s)
            self.tier.adopt(adopt_owner, hashes)
        self.num_blocks_sent += len(blocks)
        return blocks, self.tier.value_digest(hashes[-1])

    async def send(self, body: CheckpointSend, destination: Destination) -> CheckpointSent:
        """Send the blocks of `body.token_ids` (whole blocks, each checked here first) to the
        destination; CheckpointRefused names a missing or bad block, a transfer error the
        send's failure."""
        bs = self._info.block_size
        where = f"checkpoint send to {body.reservation.reservation.request_id}"
        self._check_fingerprint(body.fingerprint_digest, where)
        if len(body.token_ids) % bs:
            raise CheckpointRefused(
                Refusal.VERSION.value,
                f"{where}: {len(body.token_ids)} tokens is not whole blocks of {bs}",
            )
        hashes = prefix_block_hashes(body.token_ids, bs)
        # Copies: the owner may be released while the bytes travel.
        blocks = [memoryview(bytes(v)) for v in self.tier.read(hashes, body.fingerprint_digest)]
        if body.adopt_owner is not None:
            self._lease(body.adopt_owner, body.lease_ttl_s)
            self.tier.adopt(body.adopt_owner, hashes)
        start = time.monotonic()
        try:
            num_bytes = await self._sender.send(
                destination,
                body.reservation.reservation.request_id,
                body.token_ids,
                blocks,
                self._put_timeout_s,
                value_digest=self.tier.value_digest(hashes[-1]),
            )
        except PdserveError as exc:
            self.send_failures[type(exc).__name__] += 1
            raise
        self.num_blocks_sent += len(blocks)
        self.num_bytes_sent += num_bytes
        return CheckpointSent(
            num_blocks=len(blocks), num_bytes=num_bytes, seconds=time.monotonic() - start
        )

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
