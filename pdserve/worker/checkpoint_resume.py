"""A resumed request's first step: pull the longest checkpointed prefix of its KV.

When the router migrates a request whose decode worker died, it tells the new decode worker
where the request's checkpoint is (`GenerateRequest.checkpoint_from`). Before the ordinary
`/generate` runs, this worker:

    1. counts the leading full blocks its own prefix cache already holds (nearest cache
       first: nothing travels for those);
    2. asks the holder (/checkpoint/lookup) how many leading blocks of prompt + output it
       holds; fewer than the local ones: nothing to pull;
    3. allocates fresh blocks for them and expects their transfer (a plan naming the blocks'
       tokens: the transfer checks count, token digest, fingerprint and every chunk's
       checksum), then asks the holder to send them to a reservation signed with the
       cluster's key (/checkpoint/send; the holder checks version, fingerprint and checksum
       of every block before it sends, and refuses a bad one);
    4. verified: the blocks are registered in the prefix cache and freed to it, so the
       request's admission finds them cached and recomputes only the tokens after them.
       Anything else: the writer is fenced, the blocks freed unregistered, and the request
       recomputes everything, as without checkpoints.

Every outcome is a `Pull` (path and reason: the metric's labels). It never raises: a resume
must not fail because its checkpoint did.

It knows the engine loop, the KV receiver, the peer client and the reservation signer.
"""

from __future__ import annotations

import asyncio
import enum
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.engine.canary import CanaryMatch, ValueDigest, compare
from pdserve.engine.engine import Engine
from pdserve.errors import CheckpointRefused, PdserveError, PeerCallError, ProtocolError
from pdserve.transfer.messages import token_digest
from pdserve.transfer.receiver import IncomingTransfer, KVReceiver
from pdserve.transfer.receiver_session import ReceivePlan
from pdserve.worker.checkpoint_protocol import (
    CheckpointFound,
    CheckpointLookup,
    CheckpointSend,
    CheckpointSent,
)
from pdserve.worker.checkpoint_store import CheckpointStore
from pdserve.worker.engine_loop import EngineInfo, EngineLoop
from pdserve.worker.kv_outbox import layout_of
from pdserve.worker.peer_client import PeerClient
from pdserve.worker.protocol import CheckpointSource, KVEndpoint, Reservation
from pdserve.worker.reservation_auth import sign_reservation

_PULL_EPOCH = 0


class Path(enum.Enum):
    CHECKPOINT = "checkpoint"  # blocks pulled from the holder
    LOCAL = "local"  # this worker's prefix cache had at least as much
    RECOMPUTE = "recompute"  # nothing usable: recompute everything


@dataclass(frozen=True, slots=True)
class Pull:
    """What a resume's pull did."""

    path: Path
    # Why (a bounded label): "ok" (pulled), "own_tier" (this worker held it: copied in
    # process, no transfer), "none_held", "no_prefix_cache", "canary" (the value check
    # failed or had no digest), "holder_unreachable", "refused_<reason>",
    # "no_room", "transfer_failed".
    reason: str
    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0


class CheckpointPuller:
    """Pulls checkpoints into this worker's prefix cache."""

    def __init__(
        self,
        engine: EngineLoop,
        info: EngineInfo,
        peers: PeerClient,
        receiver: KVReceiver,
        endpoints: Callable[[], list[KVEndpoint]],
        reservation_key: bytes | None,
        *,
        store: CheckpointStore | None = None,
        canary: bool = True,
        require_canary: bool = False,
        canary_counts: Counter[str] | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self._engine = engine
        self._info = info
        self._peers = peers
        self._receiver = receiver
        self._endpoints = endpoints
        self._key = reservation_key
        self._timeout_s = timeout_s
        # This worker's own holder: a checkpoint held here is copied in process.
        self._store = store
        # Check pulled blocks by value (`--kv-canary`); results counted with the handoffs'.
        self._canary = canary
        # Use only checkpoints that carry a value digest (`--checkpoint-canary`).
        self._require_canary = require_canary
        self._canary_counts: Counter[str] = (
            canary_counts if canary_counts is not None else Counter()
        )

    async def pull(
        self,
        request_id: str,
        token_ids: list[int],
        source: CheckpointSource,
        adopt_owner: str | None = None,
        lease_ttl_s: float = 30.0,
    ) -> Pull:
        """Bring the longest checkpointed prefix of `token_ids` into the prefix cache."""
        start = time.monotonic()
        info = self._info
        bs = info.block_size
        # One token is always left to compute: the step that computes it samples the next.
        usable = max(len(token_ids) - 1, 0) // bs
        local, caching = await self._engine.call(
            lambda e: (e.num_cached_prefix_blocks(token_ids), e.config.enable_prefix_caching)
        )
        if not caching:  # pulled blocks would never be found: do not pull them
            return Pull(Path.RECOMPUTE, "no_prefix_cache")
        lookup = CheckpointLookup(
            token_ids=token_ids[: usable * bs],
            fingerprint_digest=info.fingerprint_digest,
            require_value_digest=self._require_canary,
        )
        try:
            found = await self._peers.post(
                source.holder_url, "/checkpoint/lookup", lookup, CheckpointFound
            )
        except PeerCallError as exc:
            return Pull(Path.RECOMPUTE, _reason(exc))
        num_blocks = min(found.num_blocks, usable)
        if num_blocks <= local:
            return Pull(Path.LOCAL if local else Path.RECOMPUTE, "none_held", local)
        import_id = f"{request_id}#checkpoint"
        # Cancelled mid-command (the client left): the allocation is freed, not leaked.
        views = await self._engine.call(
            lambda e: e.import_begin(import_id, num_blocks),
            undo=lambda e: e.import_end(import_id, None),
        )
        if views is None:
            return Pull(Path.RECOMPUTE, "no_room")
        prefix = token_ids[: num_blocks * bs]
        if self._store is not None and found.holder_id == self._store.holder_id:
            return await self._copy_own(import_id, views, prefix, adopt_owner, lease_ttl_s, start)
        verified = asyncio.Event()
        transfer_id, capability = os.urandom(16), os.urandom(16)
        layout = layout_of(info, num_blocks)
        plan = ReceivePlan(
            transfer_id,
            capability,
            layout,
            import_id,
            len(prefix),
            token_digest(prefix),
            epoch=_PULL_EPOCH,
        )
        ok = False
        incoming = IncomingTransfer(plan, views, verified.set)
        try:
            self._receiver.expect(incoming)
            reservation = Reservation(
                request_id=import_id,
                transfer_id=transfer_id.hex(),
                capability_token=capability.hex(),
                endpoints=self._endpoints(),
                lease_epoch=_PULL_EPOCH,
                num_cached_tokens=0,
                lease_ttl_s=self._timeout_s,
            )
            body = CheckpointSend(
                token_ids=prefix,
                fingerprint_digest=info.fingerprint_digest,
                reservation=sign_reservation(
                    self._key, reservation, None, time.time() + self._timeout_s
                ),
                adopt_owner=adopt_owner,
                lease_ttl_s=lease_ttl_s,
            )
            try:
                async with asyncio.timeout(self._timeout_s):
                    sent = await self._peers.post(
                        source.holder_url,
                        "/checkpoint/send",
                        body,
                        CheckpointSent,
                        timeout_s=self._timeout_s,
                    )
                    await verified.wait()
            except PeerCallError as exc:
                return Pull(Path.RECOMPUTE, _reason(exc))
            except TimeoutError:
                return Pull(Path.RECOMPUTE, "transfer_failed")
            digest = incoming.session.value_digest if incoming.session is not None else b""
            if not await self._value_ok(import_id, prefix, digest):
                return Pull(Path.RECOMPUTE, "canary")
            ok = True
            return Pull(Path.CHECKPOINT, "ok", num_blocks, sent.num_bytes, time.monotonic() - start)
        finally:
            # Shielded as one: a cancelled caller (the client left) must neither free blocks
            # a writer can still land bytes in nor leave them allocated.
            keep = prefix if ok else None
            await asyncio.shield(self._end_import(import_id, keep, transfer_id))

    async def _copy_own(
        self,
        import_id: str,
        views: list[memoryview],
        prefix: list[int],
        adopt_owner: str | None,
        lease_ttl_s: float,
        start: float,
    ) -> Pull:
        """The checkpoint is in this worker's own tier: check and copy it, no transfer."""
        assert self._store is not None
        ok = False
        try:
            digest = self._info.fingerprint_digest
            try:
                blocks, value = self._store.read_local(prefix, digest, adopt_owner, lease_ttl_s)
            except CheckpointRefused:
                return Pull(Path.RECOMPUTE, "refused")
            # The import's blocks belong to no running request: nothing else touches them.
            for view, block in zip(views, blocks, strict=True):
                view[:] = block
            if not await self._value_ok(import_id, prefix, value):
                return Pull(Path.RECOMPUTE, "canary")
            ok = True
            num_bytes = sum(b.nbytes for b in blocks)
            elapsed = time.monotonic() - start
            return Pull(Path.CHECKPOINT, "own_tier", len(blocks), num_bytes, elapsed)
        finally:
            keep = prefix if ok else None
            await asyncio.shield(self._end_import(import_id, keep))

    async def _end_import(
        self, import_id: str, keep: list[int] | None, transfer_id: bytes | None = None
    ) -> None:
        """Fence the pull's writer (no write after this), then free the import's blocks,
        registered in the prefix cache when `keep` names their tokens."""
        if transfer_id is not None:
            await self._receiver.fence(transfer_id)
        await self._engine.call(lambda e: e.import_end(import_id, keep))

    async def _value_ok(self, import_id: str, prefix: list[int], digest: bytes) -> bool:
        """The canary (invariant 8) on imported blocks, where the writer sent a digest: the last
        position's logits recomputed from them must match it. False when it differs or does
        not parse, or is missing while required; counted by result ("unchecked": no digest,
        none required)."""
        counts = self._canary_counts
        if not self._canary:
            return True
        if not digest:
            counts["unchecked" if not self._require_canary else "missing"] += 1
            return not self._require_canary
        try:
            want = ValueDigest.decode(digest)
        except ProtocolError:
            counts[CanaryMatch.MISMATCH.value] += 1
            return False
        position, token, dtype = len(prefix) - 1, prefix[-1], self._info.dtype

        def check(engine: Engine) -> CanaryMatch:
            logits = engine.position_logits(engine.block_ids(import_id), token, position)
            return compare(want, logits, position, dtype).match

        match = await self._engine.call(check)
        counts[match.value] += 1
        return match is not CanaryMatch.MISMATCH


def _reason(exc: PdserveError) -> str:
    """A bounded label for a failed holder call."""
    if isinstance(exc, PeerCallError):
        if exc.status == 0:
            return "holder_unreachable"
        if exc.error_type == "CheckpointRefused":
            return "refused"
    return "holder_error"
