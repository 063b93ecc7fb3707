"""A resumed request's first step: pull the longest stored prefix of its KV.

When the router migrates a request whose decode worker died, it tells the new decode worker
where the request's KV may be (`GenerateRequest.checkpoint_from`: the checkpoint holder, and
workers whose prefix caches may hold leading blocks of it, such as its prefill worker).
Before the ordinary `/generate` runs, this worker:

    1. counts the leading full blocks its own prefix cache already holds (nearest cache
       first: nothing travels for those);
    2. asks the holder (/checkpoint/lookup) and each cache source (/cache/lookup), at once,
       how many leading blocks of prompt + output they hold; none more than the local ones:
       nothing to pull;
    3. from the longest (the holder on a tie): allocates fresh blocks and expects their
       transfer (a plan naming the blocks' tokens: the transfer checks count, token digest,
       fingerprint and every chunk's checksum), then asks the source to send them to a
       reservation signed with the cluster's key (/checkpoint/send or /cache/send; the holder
       checks version, fingerprint and checksum of every block before it sends, a cache
       source copies its blocks and their value digest in one engine command);
    4. verified (and checked by value where a digest came): the blocks are registered in the
       prefix cache and freed to it, so the request's admission finds them cached and
       recomputes only the tokens after them. Anything else: the writer is fenced, the blocks
       freed unregistered, and the next source is tried; when none is left the request
       recomputes everything, as without checkpoints.

Every outcome is a `Pull` (path and reason: the metric's labels). It never raises: a resume
must not fail because its checkpoint did.

It knows the engine loop, the KV receiver, the peer client and the reservation signer.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from pdserve.engine.canary import CanaryMatch, ValueDigest, compare
from pdserve.engine.engine import Engine
from pdserve.errors import CheckpointRefused, PdserveError, PeerCallError, ProtocolError
from pdserve.protocol.checkpoint_api import (
    CheckpointFound,
    CheckpointLookup,
    CheckpointSend,
    CheckpointSent,
)
from pdserve.protocol.reservation_signing import sign_reservation
from pdserve.protocol.worker_api import CheckpointSource, KVEndpoint
from pdserve.transfer.receiver import IncomingTransfer, KVReceiver
from pdserve.worker.checkpoint.peer_client import PeerClient
from pdserve.worker.checkpoint.store import CheckpointStore, import_plan, import_reservation
from pdserve.worker.engine_loop import EngineInfo, EngineLoop


class Path(enum.Enum):
    CHECKPOINT = "checkpoint"  # blocks pulled from the holder
    PEER_CACHE = "peer_cache"  # blocks pulled from another worker's prefix cache
    LOCAL = "local"  # this worker's prefix cache had at least as much
    RECOMPUTE = "recompute"  # nothing usable: recompute everything


@dataclass(frozen=True, slots=True)
class _Offer:
    """One source's answer to a lookup: how many leading blocks it can send."""

    path: Path  # CHECKPOINT (a holder's tier) or PEER_CACHE (a worker's prefix cache)
    url: str
    num_blocks: int
    source_id: str


@dataclass(frozen=True, slots=True)
class Pull:
    """What a resume's pull did."""

    path: Path
    # Why (a bounded label): "ok" (pulled), "own_tier" (this worker held it: copied in
    # process, no transfer), "none_held", "no_prefix_cache", "canary" (the value check
    # failed or had no digest), "holder_unreachable", "refused", "holder_error",
    # "cache_unreachable", "cache_refused", "cache_error", "no_room", "transfer_failed".
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
        """Bring the longest stored prefix of `token_ids` (the holder's checkpoint or a
        peer's prefix cache, whichever holds more) into this worker's prefix cache."""
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
        offers, failure = await self._offers(source, lookup, usable)
        better = [o for o in offers if o.num_blocks > local]
        if not better:
            if failure is not None and not offers:
                return failure
            return Pull(Path.LOCAL if local else Path.RECOMPUTE, "none_held", local)
        # Longest first (the holder first on a tie: its blocks can be adopted); a source that
        # fails hands over to the next, and the last failure is the answer.
        result = Pull(Path.RECOMPUTE, "none_held")
        for offer in sorted(better, key=lambda o: -o.num_blocks):
            result = await self._pull_from(offer, request_id, token_ids, adopt_owner, lease_ttl_s)
            if result.path is not Path.RECOMPUTE:
                return replace(result, seconds=time.monotonic() - start)
        return result

    async def _offers(
        self, source: CheckpointSource, lookup: CheckpointLookup, usable: int
    ) -> tuple[list[_Offer], Pull | None]:
        """Ask the holder and every cache source at once how many leading blocks each has;
        the answers (holder first) and the holder's failure, if it failed."""
        asks: list[tuple[Path, str]] = []
        if source.holder_url is not None:
            asks.append((Path.CHECKPOINT, source.holder_url))
        asks += [(Path.PEER_CACHE, url) for url in source.cache_urls if url != source.holder_url]

        async def ask(path: Path, url: str) -> CheckpointFound:
            route = "/checkpoint/lookup" if path is Path.CHECKPOINT else "/cache/lookup"
            return await self._peers.post(url, route, lookup, CheckpointFound)

        answers = await asyncio.gather(*(ask(p, u) for p, u in asks), return_exceptions=True)
        offers: list[_Offer] = []
        failure: Pull | None = None
        for (path, url), answer in zip(asks, answers, strict=True):
            if isinstance(answer, PdserveError):
                if failure is None:
                    failure = Pull(Path.RECOMPUTE, _reason(answer, path))
                continue
            if isinstance(answer, BaseException):
                raise answer
            offers.append(_Offer(path, url, min(answer.num_blocks, usable), answer.holder_id))
        return offers, failure

    async def _pull_from(
        self,
        offer: _Offer,
        request_id: str,
        token_ids: list[int],
        adopt_owner: str | None,
        lease_ttl_s: float,
    ) -> Pull:
        """Pull the offer's blocks over the KV transport (or copy this worker's own tier)."""
        start = time.monotonic()
        info = self._info
        num_blocks = offer.num_blocks
        holder = offer.path is Path.CHECKPOINT
        import_id = f"{request_id}#{offer.path.value}"
        # Cancelled mid-command (the client left): the allocation is freed, not leaked.
        views = await self._engine.call(
            lambda e: e.import_begin(import_id, num_blocks),
            undo=lambda e: e.import_end(import_id, None),
        )
        if views is None:
            return Pull(Path.RECOMPUTE, "no_room")
        prefix = token_ids[: num_blocks * info.block_size]
        if holder and self._store is not None and offer.source_id == self._store.holder_id:
            return await self._copy_own(import_id, views, prefix, adopt_owner, lease_ttl_s, start)
        verified = asyncio.Event()
        plan = import_plan(info, import_id, prefix, num_blocks)
        ok = False
        incoming = IncomingTransfer(plan, views, verified.set)
        try:
            self._receiver.expect(incoming)
            reservation = import_reservation(
                plan, self._receiver, self._endpoints(), self._timeout_s
            )
            body = CheckpointSend(
                token_ids=prefix,
                fingerprint_digest=info.fingerprint_digest,
                reservation=sign_reservation(
                    self._key, reservation, None, time.time() + self._timeout_s
                ),
                adopt_owner=adopt_owner if holder else None,
                lease_ttl_s=lease_ttl_s,
            )
            route = "/checkpoint/send" if holder else "/cache/send"
            try:
                async with asyncio.timeout(self._timeout_s):
                    sent = await self._peers.post(
                        offer.url, route, body, CheckpointSent, timeout_s=self._timeout_s
                    )
                    await verified.wait()
            except PeerCallError as exc:
                return Pull(Path.RECOMPUTE, _reason(exc, offer.path))
            except TimeoutError:
                return Pull(Path.RECOMPUTE, "transfer_failed")
            digest = incoming.session.value_digest if incoming.session is not None else b""
            if not await self._value_ok(import_id, prefix, digest):
                return Pull(Path.RECOMPUTE, "canary")
            ok = True
            seconds = time.monotonic() - start
            return Pull(offer.path, "ok", num_blocks, sent.num_bytes, seconds)
        finally:
            # Shielded as one: a cancelled caller (the client left) must neither free blocks
            # a writer can still land bytes in nor leave them allocated.
            keep = prefix if ok else None
            await asyncio.shield(self._end_import(import_id, keep, plan.transfer_id))

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
            engine.import_landed(import_id)
            logits = engine.position_logits(engine.block_ids(import_id), token, position)
            return compare(want, logits, position, dtype).match

        match = await self._engine.call(check)
        counts[match.value] += 1
        return match is not CanaryMatch.MISMATCH


def _reason(exc: PdserveError, path: Path = Path.CHECKPOINT) -> str:
    """A bounded label for a failed call to a holder (or, with `path` PEER_CACHE, to a cache
    source: "cache_unreachable", "cache_refused", "cache_error")."""
    prefix = "holder" if path is Path.CHECKPOINT else "cache"
    if isinstance(exc, PeerCallError):
        if exc.status == 0:
            return f"{prefix}_unreachable"
        if exc.error_type == "CheckpointRefused":
            return "refused" if path is Path.CHECKPOINT else "cache_refused"
    return f"{prefix}_error"
