"""The decode side of decode checkpoints: a decoding request's KV replicated to its holder.

Life cycle of one request's replica (`Replica`, all on the event loop's thread):

    open (the router's CheckpointPlan)
      each token: `advance` ── is a batch due (`CheckpointPolicy.next_batch`)? ──► wake the task
      the task: copy the blocks [sent, target) on the engine thread (between steps)
                over the holder's link, when it has one and the put rides TCP: one Put frame
                  (tokens, parent, version, checksummed copies) and its Ack
                else POST holder /checkpoint/put (their tokens) -> a reservation in its host
                  tier, then the copies in a transfer session (checksummed, fingerprinted,
                  acked); the reservation names the holder's TCP endpoint for the next puts
                sent = target; the chained hash of the last block is the next put's parent
      every TTL/3: POST holder /checkpoint/renew (the owner's lease)
    close (the request ended, however) ──► POST holder /checkpoint/release (best effort:
                                            the lease ends it anyway)

Invariants:
- The request never waits for its checkpoint: tokens are streamed whatever the replica does;
  the only engine work is the copy, one command between two steps.
- Holder failure is harmless: any failed call or send makes the replica stop (counted); the
  holder's lease then drops what it held. The request goes on without checkpoints.
- Version = tokens covered: a put names its first block's version ((index + 1) * block_size),
  and the holder checks that it continues the chain it holds.

It knows the engine loop, the peer client and the block sender; not HTTP handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.engine.block_manager import hash_block_tokens
from pdserve.engine.canary import ValueDigest
from pdserve.engine.engine import Engine
from pdserve.engine.outputs import RequestDelta
from pdserve.errors import LinkUnsupported, PdserveError, RequestNotFound
from pdserve.protocol.checkpoint_api import (
    CheckpointOwner,
    CheckpointPut,
    CheckpointReleased,
    CheckpointRenewed,
)
from pdserve.protocol.checkpoint_policy import CheckpointPolicy
from pdserve.protocol.worker_api import CheckpointPlan, Reservation, Transport
from pdserve.transfer.codec import MAX_DATA_BYTES
from pdserve.transfer.messages import MAX_PUT_TOKENS, Put
from pdserve.transfer.stream import Address
from pdserve.worker.checkpoint.link import CheckpointLinks
from pdserve.worker.checkpoint.peer_client import PeerClient
from pdserve.worker.checkpoint.sender import BlockSender, put_request_id
from pdserve.worker.engine_loop import EngineInfo, EngineLoop
from pdserve.worker.kv import transports as kv_transports
from pdserve.worker.kv.outbox import destination_of

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StreamCounters:
    """What this worker's replicas did (the /metrics counters)."""

    num_puts: int = 0
    num_blocks_put: int = 0
    num_bytes_put: int = 0
    # Puts sent over a replication link (the rest went through a transfer session each).
    num_link_puts: int = 0
    # Bytes put, by the transport that carried them (small puts ride TCP under auto).
    bytes_by_transport: Counter[str] = field(default_factory=Counter)
    # Replicas that stopped because the holder failed, by error class.
    failures: Counter[str] = field(default_factory=Counter)


class Replica:
    """One request's checkpoint stream to its holder."""

    def __init__(
        self,
        owner: str,
        plan: CheckpointPlan,
        policy: CheckpointPolicy,
        token_ids: Sequence[int],
        num_prompt_tokens: int,
        streams: CheckpointStreams,
        num_sent_blocks: int = 0,
        computed: bool = True,
    ) -> None:
        self.owner = owner
        self.plan = plan
        self.policy = policy
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_sent_blocks = num_sent_blocks
        self.stopped = False
        self._streams = streams
        self._wake = asyncio.Event()
        # KV that is in place (a handoff's, received before the stream) goes at once; a request
        # the engine has not run yet holds no blocks until it does, so its first tokens (the
        # whole prompt computed, or found in the prefix cache) are what wakes the replica.
        if computed:
            self._wake.set()
        self._parent_hash = 0
        bs = streams.info.block_size
        for i in range(num_sent_blocks):
            self._parent_hash = hash_block_tokens(
                self._parent_hash, self.token_ids[i * bs : (i + 1) * bs]
            )
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run())
        self._renewer = loop.create_task(self._renew())

    def advance(self, new_token_ids: Sequence[int]) -> None:
        """The request produced these tokens (every one before the last has KV now)."""
        self.token_ids.extend(new_token_ids)
        if self._due():
            self._wake.set()

    def _due(self) -> range:
        bs = self._streams.info.block_size
        # The newest token's KV is written by the step that samples the next one.
        num_full = max(len(self.token_ids) - 1, 0) // bs
        return self.policy.next_batch(self.num_prompt_tokens, num_full, self.num_sent_blocks, bs)

    async def _run(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                batch = self._due()
                if batch:
                    await self._put(batch)
        except asyncio.CancelledError:
            raise
        except RequestNotFound:
            # The request ended (its blocks are gone) before the copy: nothing left to send.
            self.stopped = True
            self._renewer.cancel()
        except PdserveError as exc:
            self._fail(exc)
        except Exception as exc:  # never let a checkpoint bug touch the request
            log.exception("checkpoint replica of %s failed", self.owner)
            self._fail(exc)

    async def _put(self, batch: range) -> None:
        s = self._streams
        bs = s.info.block_size
        start, end = batch.start, batch.stop
        snapshot = _snapshot(self.owner, start, end, self.token_ids[end * bs - 1], bs, s.canary)
        blocks, value_digest = await s.engine.call(snapshot)
        block_tokens = [self.token_ids[i * bs : (i + 1) * bs] for i in range(start, end)]
        tokens = [t for block in block_tokens for t in block]
        views = [memoryview(b) for b in blocks]
        address = s.link_address(self.plan.holder_url, len(blocks) * s.info.block_bytes, tokens)
        num_bytes, transport = 0, ""
        if address is not None and s.links is not None:
            put = Put(
                self.owner,
                self._parent_hash,
                (start + 1) * bs,
                tuple(tokens),
                self.plan.lease_ttl_s,
                value_digest,
            )
            try:
                instance = s.holder_instance(self.plan.holder_url)
                num_bytes, transport = await s.links.put(address, put, views, instance), "tcp"
                s.counters.num_link_puts += 1
            except LinkUnsupported:
                # An older holder: this put and its later ones go through sessions.
                s.forget_link(self.plan.holder_url)
        if not transport:
            num_bytes, transport = await self._put_in_session(
                start, block_tokens, tokens, views, value_digest
            )
        for block in block_tokens:
            self._parent_hash = hash_block_tokens(self._parent_hash, block)
        self.num_sent_blocks = end
        s.counters.num_puts += 1
        s.counters.num_blocks_put += end - start
        s.counters.num_bytes_put += num_bytes
        s.counters.bytes_by_transport[transport] += num_bytes

    async def _put_in_session(
        self,
        start: int,
        block_tokens: list[list[int]],
        tokens: list[int],
        views: list[memoryview],
        value_digest: bytes,
    ) -> tuple[int, str]:
        """A put through an HTTP reservation and a transfer session: bytes, transport."""
        s = self._streams
        bs = s.info.block_size
        body = CheckpointPut(
            owner=self.owner,
            fingerprint_digest=s.info.fingerprint_digest,
            parent_hash=self._parent_hash,
            first_version=(start + 1) * bs,
            block_tokens=block_tokens,
            lease_ttl_s=self.plan.lease_ttl_s,
        )
        reservation = await s.peers.post(self.plan.holder_url, "/checkpoint/put", body, Reservation)
        s.learn_holder(self.plan.holder_url, reservation)
        local = s.transports_for(len(views) * s.info.block_bytes)
        destination = destination_of(reservation, None, local=local, explicit=False)
        num_bytes = await s.sender.send(
            destination,
            put_request_id(self.owner, body.first_version),
            tokens,
            views,
            s.send_timeout_s,
            value_digest=value_digest,
        )
        return num_bytes, destination.transport

    async def _renew(self) -> None:
        body = CheckpointOwner(owner=self.owner, lease_ttl_s=self.plan.lease_ttl_s)
        period = self.plan.lease_ttl_s / 3
        try:
            while True:
                await asyncio.sleep(period)
                await self._streams.peers.post(
                    self.plan.holder_url, "/checkpoint/renew", body, CheckpointRenewed
                )
        except PdserveError as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if not self.stopped:
            self.stopped = True
            self._streams.counters.failures[type(exc).__name__] += 1
            log.info("checkpoint of %s stopped: %s", self.owner, exc)
            self._task.cancel()
            self._renewer.cancel()

    async def close(self) -> None:
        """The request ended: stop, and release the holder's copy in the background (best
        effort: a paused or dead holder must not hold up the end of the request's stream;
        the owner's lease ends the copy anyway)."""
        self.stopped = True
        for task in (self._task, self._renewer):
            task.cancel()
        for task in (self._task, self._renewer):
            with contextlib.suppress(BaseException):
                await task
        self._streams.release_later(self.plan.holder_url, self.owner)


def _snapshot(
    owner: str, start: int, end: int, last_token: int, block_size: int, canary: bool
) -> Callable[[Engine], tuple[list[bytes], bytes]]:
    """An engine command: copies of the blocks [start, end) and, with the canary, the value
    digest of their last position recomputed from this KV (the reader checks it by value)."""

    def snapshot(engine: Engine) -> tuple[list[bytes], bytes]:
        blocks = engine.copy_blocks(owner, start, end)
        if not canary:
            return blocks, b""
        position = end * block_size - 1
        logits = engine.position_logits(engine.block_ids(owner), last_token, position)
        return blocks, ValueDigest.of_logits(logits, position).encode()

    return snapshot


def on_tokens(
    replica: Replica | None, first: Callable[[RequestDelta], None] | None
) -> Callable[[RequestDelta], None]:
    """What a token stream tells for each delta: `first` (once, with the first tokens) and
    the request's replica."""
    told = [first is None]

    def seen(delta: RequestDelta) -> None:
        if not delta.new_token_ids:
            return
        if not told[0] and first is not None:
            told[0] = True
            first(delta)
        if replica is not None:
            replica.advance(delta.new_token_ids)

    return seen


class CheckpointStreams:
    """Opens the replicas of one decode worker's requests."""

    def __init__(
        self,
        engine: EngineLoop,
        info: EngineInfo,
        peers: PeerClient,
        sender: BlockSender,
        local: Sequence[Transport],
        send_timeout_s: float = 10.0,
        canary: bool = False,
        small_put_bytes: int = 0,
        links: CheckpointLinks | None = None,
    ) -> None:
        self.engine = engine
        self.info = info
        self.peers = peers
        self.sender = sender
        self.local = tuple(local)
        self.send_timeout_s = send_timeout_s
        # Send the value digest of each put's last position (`--checkpoint-canary`).
        self.canary = canary
        # Puts of at most this many bytes go over TCP when this worker has it (0: never).
        self.small_put_bytes = small_put_bytes
        # Replication links to holders (None: every put in its own transfer session), and
        # each holder's TCP KV endpoint as its last reservation named it.
        self.links = links
        self._holder_tcp: dict[str, Address] = {}
        # The holder's instance its last reservation named: its link's Hello names it too.
        self._holder_instance: dict[str, bytes] = {}
        self._no_links: set[str] = set()
        self.counters = StreamCounters()
        # Releases under way (`Replica.close` does not wait for them).
        self._releases: set[asyncio.Task[None]] = set()

    def release_later(self, holder_url: str, owner: str) -> None:
        """Tell the holder, in the background, that `owner` ended (errors are ignored)."""

        async def release() -> None:
            with contextlib.suppress(PdserveError):
                await self.peers.post(
                    holder_url,
                    "/checkpoint/release",
                    CheckpointOwner(owner=owner),
                    CheckpointReleased,
                )

        task = asyncio.get_running_loop().create_task(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def aclose(self) -> None:
        """Wait briefly for releases under way, then cancel the rest."""
        if self._releases:
            await asyncio.wait(set(self._releases), timeout=1.0)
        for task in list(self._releases):
            task.cancel()

    def learn_holder(self, holder_url: str, reservation: Reservation) -> None:
        """Remember the holder's TCP endpoint (from a reservation it made) for its link."""
        if holder_url in self._no_links:
            return
        self._holder_instance[holder_url] = bytes.fromhex(reservation.instance_id)
        for i, endpoint in enumerate(reservation.endpoints):
            if endpoint.transport == "tcp":
                where = f"reservation.endpoints[{i}].address"
                self._holder_tcp[holder_url] = kv_transports.parse_address(endpoint.address, where)

    def holder_instance(self, holder_url: str) -> bytes:
        """The holder's process instance as its reservations name it (b"": not known)."""
        return self._holder_instance.get(holder_url, b"")

    def forget_link(self, holder_url: str) -> None:
        """The holder serves no links: send it every later put in a session."""
        self._holder_tcp.pop(holder_url, None)
        self._no_links.add(holder_url)

    def link_address(
        self, holder_url: str, num_bytes: int, tokens: Sequence[int]
    ) -> Address | None:
        """Where a put of `num_bytes` goes over a link (None: in a session): links on, the
        put rides TCP and fits one frame, and the holder's TCP endpoint is known."""
        if self.links is None or len(tokens) > MAX_PUT_TOKENS or num_bytes > MAX_DATA_BYTES:
            return None
        if self.transports_for(num_bytes) != ("tcp",):
            return None
        return self._holder_tcp.get(holder_url)

    def transports_for(self, num_bytes: int) -> tuple[Transport, ...]:
        """The transports a put of `num_bytes` may use: TCP alone for a small one (see
        `WorkerConfig.checkpoint_small_put_kib`), else this worker's own."""
        if num_bytes <= self.small_put_bytes and "tcp" in self.local:
            return ("tcp",)
        return self.local

    def open(
        self,
        owner: str,
        plan: CheckpointPlan,
        token_ids: Sequence[int],
        num_prompt_tokens: int,
        num_sent_blocks: int = 0,
        computed: bool = True,
    ) -> Replica | None:
        """Start replicating the request `owner` (None: its plan says off); `computed`: the KV
        of `token_ids` is in the engine already (else the first tokens say so)."""
        policy = CheckpointPolicy.parse(plan.policy, "checkpoint.policy")
        if not policy.enabled:
            return None
        return Replica(
            owner, plan, policy, token_ids, num_prompt_tokens, self, num_sent_blocks, computed
        )
