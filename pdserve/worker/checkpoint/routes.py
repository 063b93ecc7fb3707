"""A decode worker's checkpoint parts in one place: its holder (`CheckpointStore`), its
requests' replicas (`CheckpointStreams`), its resume pulls (`CheckpointPuller`), the
/checkpoint/* routes and their /metrics lines.

    POST /checkpoint/put     CheckpointPut    -> Reservation       (holder)
    POST /checkpoint/renew   CheckpointOwner  -> CheckpointRenewed (holder)
    POST /checkpoint/release CheckpointOwner  -> CheckpointReleased(holder)
    POST /checkpoint/lookup  CheckpointLookup -> CheckpointFound   (holder)
    POST /checkpoint/send    CheckpointSend   -> CheckpointSent    (holder; the reservation
                                                 must carry the cluster's signature)

It knows HTTP and the three parts; what they do is theirs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from aiohttp import web
from pydantic import BaseModel

from pdserve.auth.tls import client_context
from pdserve.checkpoint.host_tier import HostTier
from pdserve.engine.engine import Engine
from pdserve.engine.outputs import RequestDelta
from pdserve.errors import RequestNotFound
from pdserve.observability import checkpoint_metric_names as cm
from pdserve.observability.exposition import by_label, render_family, render_text, render_values
from pdserve.observability.timeline_log import EventRing
from pdserve.protocol.checkpoint_api import (
    CheckpointLookup,
    CheckpointOwner,
    CheckpointPut,
    CheckpointSend,
)
from pdserve.protocol.worker_api import CheckpointPlan, GenerateRequest, Transport
from pdserve.transfer.sender import SendPolicy
from pdserve.worker.checkpoint.link import CheckpointLinks
from pdserve.worker.checkpoint.link_server import LinkServer
from pdserve.worker.checkpoint.peer_client import PeerClient
from pdserve.worker.checkpoint.resume import CheckpointPuller, Path
from pdserve.worker.checkpoint.sender import BlockSender
from pdserve.worker.checkpoint.store import CheckpointStore
from pdserve.worker.checkpoint.stream import CheckpointStreams, Replica
from pdserve.worker.config import WorkerConfig
from pdserve.worker.engine_loop import EngineInfo, EngineLoop
from pdserve.worker.kv.inbox import KVInbox
from pdserve.worker.kv.outbox import peer_destination


def _json(body: BaseModel) -> web.Response:
    return web.json_response(text=body.model_dump_json())


class CheckpointService:
    """Holder, replicas and pulls of one decode worker."""

    def __init__(
        self,
        config: WorkerConfig,
        info: EngineInfo,
        engine: EngineLoop,
        inbox: KVInbox,
        local: Sequence[Transport],
    ) -> None:
        self._config = config
        self._engine = engine
        self._local = tuple(local)
        policy = SendPolicy(
            chunk_timeout_s=config.transfer_chunk_timeout_s, frame_bytes=config.kv_frame_bytes
        )
        self.sender = BlockSender(info, policy, config.kv_key)
        self.peers = PeerClient(config.http_key, client_context(config.tls))
        tier = HostTier(config.checkpoint_capacity_mb << 20, info.block_size, info.block_bytes)
        self.store = CheckpointStore(
            tier, info, inbox.receiver, lambda: inbox.endpoints, self.sender
        )
        small_put = config.checkpoint_small_put_kib << 10 if config.kv_transport == "auto" else 0
        # Links both ways: this worker's replicas send on them, its holder serves them.
        self.links = CheckpointLinks(info, config.kv_key) if config.checkpoint_links else None
        self.link_server = LinkServer(self.store, info, config.kv_key, inbox.receiver.limits)
        inbox.receiver.link_handler = self.link_server.serve
        self.streams = CheckpointStreams(
            engine,
            info,
            self.peers,
            self.sender,
            local,
            canary=config.checkpoint_canary,
            small_put_bytes=small_put,
            links=self.links,
        )
        self.canary_counts: Counter[str] = Counter()
        self.puller = CheckpointPuller(
            engine,
            info,
            self.peers,
            inbox.receiver,
            lambda: inbox.endpoints,
            config.reservation_key,
            store=self.store,
            canary=config.kv_canary,
            require_canary=config.checkpoint_canary,
            canary_counts=self.canary_counts,
        )
        # Resumes by (path, reason); tokens they had to restore and recomputed; bytes pulled.
        self.resumes: Counter[tuple[str, str]] = Counter()
        self.num_resumed_tokens = 0
        self.num_recomputed_tokens = 0
        self.num_pulled_bytes = 0

    def start(self) -> None:
        self.store.start()

    async def aclose(self) -> None:
        await self.streams.aclose()
        await self.store.aclose()
        if self.links is not None:
            await self.links.aclose()
        await self.sender.aclose()
        await self.peers.aclose()

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/checkpoint/put", self.put),
            web.post("/checkpoint/renew", self.renew),
            web.post("/checkpoint/release", self.release),
            web.post("/checkpoint/lookup", self.lookup),
            web.post("/checkpoint/send", self.send),
        ]

    # ---- the request's side --------------------------------------------------------------

    async def open_replica(
        self,
        rid: str,
        plan: CheckpointPlan,
        outputs: list[int],
        num_sent_blocks: int,
        computed: bool,
    ) -> Replica | None:
        """Start replicating the request's KV (None: off, or it already ended); `computed`: its
        KV is in the engine already (a handoff's), else the first tokens start the puts."""

        def prompt_of(engine: Engine) -> list[int] | None:
            try:
                return list(engine.get_request(rid).prompt_token_ids)
            except RequestNotFound:
                return None

        prompt = await self._engine.call(prompt_of)
        if prompt is None:
            return None
        tokens = [*prompt, *outputs]
        return self.streams.open(rid, plan, tokens, len(prompt), num_sent_blocks, computed)

    async def pull_for(
        self, body: GenerateRequest, events: EventRing
    ) -> tuple[Callable[[RequestDelta], None], int]:
        """Pull a resume's checkpoint into the prefix cache (never fails): what to tell with
        the first tokens (how many the engine found cached), and the blocks the request's
        own replica took over at the holder."""
        assert body.checkpoint_from is not None
        source, plan = body.checkpoint_from, body.checkpoint
        tokens = [*body.prompt_token_ids, *body.output_token_ids]
        adopt = plan is not None and plan.holder_url == source.holder_url
        pull = await self.puller.pull(
            body.request_id,
            tokens,
            source,
            adopt_owner=body.request_id if adopt else None,
            lease_ttl_s=plan.lease_ttl_s if plan is not None else 30.0,
        )
        events.record(
            body.request_id,
            "checkpoint_pull",
            f"path={pull.path.value} reason={pull.reason} blocks={pull.num_blocks}"
            f" bytes={pull.num_bytes}",
        )
        self.resumes[(pull.path.value, pull.reason)] += 1
        self.num_pulled_bytes += pull.num_bytes
        self.num_resumed_tokens += len(tokens)

        def first(delta: RequestDelta) -> None:
            self.num_recomputed_tokens += max(len(tokens) - delta.num_cached_tokens, 0)

        return first, pull.num_blocks if adopt and pull.path is Path.CHECKPOINT else 0

    # ---- holder routes -------------------------------------------------------------------

    async def put(self, request: web.Request) -> web.Response:
        body = CheckpointPut.model_validate_json(await request.read())
        return _json(self.store.put(body))

    async def renew(self, request: web.Request) -> web.Response:
        body = CheckpointOwner.model_validate_json(await request.read())
        return _json(self.store.renew(body.owner, body.lease_ttl_s))

    async def release(self, request: web.Request) -> web.Response:
        body = CheckpointOwner.model_validate_json(await request.read())
        return _json(self.store.release(body.owner))

    async def lookup(self, request: web.Request) -> web.Response:
        body = CheckpointLookup.model_validate_json(await request.read())
        return _json(self.store.lookup(body))

    async def send(self, request: web.Request) -> web.Response:
        body = CheckpointSend.model_validate_json(await request.read())
        destination = peer_destination(body.reservation, self._config.reservation_key, self._local)
        return _json(await self.store.send(body, destination))

    # ---- metrics -------------------------------------------------------------------------

    def render(self, worker_id: str) -> str:
        """Prometheus lines of every checkpoint counter and gauge."""
        w = {"worker_id": worker_id}
        tier, store, counters = self.store.tier, self.store, self.streams.counters
        lines = render_family(
            cm.WORKER_CHECKPOINT_RESUMES,
            [({**w, "path": p, "reason": r}, n) for (p, r), n in sorted(self.resumes.items())],
        )
        lines += render_values(
            w,
            [
                (cm.WORKER_CHECKPOINT_RESUMED_TOKENS, self.num_resumed_tokens),
                (cm.WORKER_CHECKPOINT_RECOMPUTED_TOKENS, self.num_recomputed_tokens),
                (cm.WORKER_CHECKPOINT_PULLED_BYTES, self.num_pulled_bytes),
                (cm.WORKER_CHECKPOINT_PUT_BLOCKS, counters.num_blocks_put),
                (cm.WORKER_CHECKPOINT_PUT_BYTES, counters.num_bytes_put),
                (cm.WORKER_CHECKPOINT_HELD_BLOCKS, tier.num_blocks),
                (cm.WORKER_CHECKPOINT_HELD_BYTES, tier.used_bytes + tier.reserved_bytes),
                (cm.WORKER_CHECKPOINT_OWNERS, tier.num_owners),
                (cm.WORKER_CHECKPOINT_LEASE_EXPIRIES, store.num_lease_expiries),
            ],
        )
        lines += render_family(
            cm.WORKER_CHECKPOINT_PUT_TRANSPORT_BYTES,
            by_label(w, "transport", counters.bytes_by_transport),
        )
        num_link = counters.num_link_puts
        paths = {"link": num_link, "session": counters.num_puts - num_link}
        lines += render_family(cm.WORKER_CHECKPOINT_PUTS, by_label(w, "path", paths))
        lines += render_family(
            cm.WORKER_CHECKPOINT_LINK_PUTS_RECEIVED,
            by_label(w, "result", self.link_server.puts),
        )
        lines += render_family(
            cm.WORKER_CHECKPOINT_STREAM_FAILURES, by_label(w, "error", counters.failures)
        )
        lines += render_family(
            cm.WORKER_CHECKPOINT_CANARY, by_label(w, "result", self.canary_counts)
        )
        lines += render_family(cm.WORKER_CHECKPOINT_REFUSALS, by_label(w, "reason", tier.refused))
        return render_text(lines)
