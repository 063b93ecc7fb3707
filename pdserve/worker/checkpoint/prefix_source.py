"""Any worker's prefix cache as a source of a resumed request's KV (nearest cache first).

A decode worker that resumes a migrated request asks its checkpoint holder and the workers
whose prefix caches may hold the request's leading blocks (the router names them: the
request's prefill worker, workers its KV-event index says hold the prefix) how much each
has, and pulls from the longest. This module answers those two calls from the engine's prefix
cache, with the holder's bodies, so the puller treats a cache exactly like a holder:

    POST /cache/lookup  CheckpointLookup -> CheckpointFound  (leading cached full blocks)
    POST /cache/send    CheckpointSend   -> CheckpointSent   (copies of them, sent to a
                                             reservation the cluster signed)

The copies and the value digest of their last position are taken in one engine command, so
no eviction can slip between the lookup of a block and its copy; full cached blocks never
change. The digest (one token's forward over the copied blocks) lets the puller check the
blocks by value, as it checks a checkpoint's. Prefix caching off: lookups answer 0.

It knows the engine loop and the block sender; not the holder's tier or the puller.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

from aiohttp import web

from pdserve.checkpoint.holder import Refusal
from pdserve.engine.canary import ValueDigest
from pdserve.engine.engine import Engine
from pdserve.errors import CheckpointRefused, PdserveError
from pdserve.observability import checkpoint_metric_names as cm
from pdserve.observability.exposition import by_label, render_family, render_text, render_values
from pdserve.protocol.checkpoint_api import (
    CheckpointFound,
    CheckpointLookup,
    CheckpointSend,
    CheckpointSent,
)
from pdserve.protocol.worker_api import Transport
from pdserve.transfer.sender import SendPolicy
from pdserve.worker.checkpoint.sender import BlockSender
from pdserve.worker.checkpoint.store import check_fingerprint
from pdserve.worker.config import WorkerConfig
from pdserve.worker.engine_loop import EngineInfo, EngineLoop
from pdserve.worker.kv.outbox import peer_destination


class PrefixCacheSource:
    """Serves leading blocks of this worker's prefix cache to resuming peers."""

    def __init__(
        self,
        config: WorkerConfig,
        info: EngineInfo,
        engine: EngineLoop,
        local: Sequence[Transport],
        send_timeout_s: float = 10.0,
    ) -> None:
        self._config = config
        self._info = info
        self._engine = engine
        self._local = tuple(local)
        self._send_timeout_s = send_timeout_s
        policy = SendPolicy(
            chunk_timeout_s=config.transfer_chunk_timeout_s, frame_bytes=config.kv_frame_bytes
        )
        self.sender = BlockSender(info, policy, config.kv_key)
        # A lookup answer names this source, never a holder's tier.
        self.source_id = f"cache:{config.worker_id}"
        self.num_lookups = 0
        self.num_blocks_sent = 0
        self.num_bytes_sent = 0
        self.refused: Counter[str] = Counter()
        self.send_failures: Counter[str] = Counter()

    async def aclose(self) -> None:
        await self.sender.aclose()

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/cache/lookup", self.lookup), web.post("/cache/send", self.send)]

    async def lookup(self, request: web.Request) -> web.Response:
        body = CheckpointLookup.model_validate_json(await request.read())
        check_fingerprint(self._info, body.fingerprint_digest, "cache lookup", self.refused)
        self.num_lookups += 1
        n = await self._engine.call(lambda e: e.num_cached_prefix_blocks(body.token_ids))
        found = CheckpointFound(
            num_blocks=n, version=n * self._info.block_size, holder_id=self.source_id
        )
        return web.json_response(text=found.model_dump_json())

    async def send(self, request: web.Request) -> web.Response:
        body = CheckpointSend.model_validate_json(await request.read())
        bs = self._info.block_size
        where = f"cache send to {body.reservation.reservation.request_id}"
        check_fingerprint(self._info, body.fingerprint_digest, where, self.refused)
        if len(body.token_ids) % bs:
            self.refused[Refusal.VERSION.value] += 1
            raise CheckpointRefused(
                Refusal.VERSION.value,
                f"{where}: {len(body.token_ids)} tokens is not whole blocks of {bs}",
            )
        destination = peer_destination(body.reservation, self._config.reservation_key, self._local)
        tokens = body.token_ids
        blocks, digest = await self._engine.call(lambda e: _copy_with_digest(e, tokens, bs))
        if len(blocks) * bs < len(tokens):
            self.refused[Refusal.MISSING.value] += 1
            raise CheckpointRefused(
                Refusal.MISSING.value,
                f"{where}: the prefix cache holds {len(blocks)} of {len(tokens) // bs} blocks",
            )
        start = time.monotonic()
        try:
            num_bytes = await self.sender.send(
                destination,
                body.reservation.reservation.request_id,
                tokens,
                [memoryview(b) for b in blocks],
                self._send_timeout_s,
                value_digest=digest,
            )
        except PdserveError as exc:
            self.send_failures[type(exc).__name__] += 1
            raise
        self.num_blocks_sent += len(blocks)
        self.num_bytes_sent += num_bytes
        sent = CheckpointSent(
            num_blocks=len(blocks), num_bytes=num_bytes, seconds=time.monotonic() - start
        )
        return web.json_response(text=sent.model_dump_json())

    def render(self, worker_id: str) -> str:
        """Prometheus lines of the cache source's counters."""
        w = {"worker_id": worker_id}
        lines = render_values(
            w,
            [
                (cm.WORKER_CACHE_SOURCE_LOOKUPS, self.num_lookups),
                (cm.WORKER_CACHE_SOURCE_SENT_BLOCKS, self.num_blocks_sent),
                (cm.WORKER_CACHE_SOURCE_SENT_BYTES, self.num_bytes_sent),
            ],
        )
        lines += render_family(cm.WORKER_CACHE_SOURCE_REFUSALS, by_label(w, "reason", self.refused))
        lines += render_family(
            cm.WORKER_CACHE_SOURCE_SEND_FAILURES, by_label(w, "error", self.send_failures)
        )
        return render_text(lines)


def _copy_with_digest(
    engine: Engine, tokens: list[int], block_size: int
) -> tuple[list[bytes], bytes]:
    """An engine command: copies of the cached leading blocks of `tokens` and the value digest
    of the last copied position (b"": none copied)."""
    ids = engine.cached_prefix_block_ids(tokens)
    blocks = engine.copy_block_ids(ids)
    if not ids:
        return blocks, b""
    position = len(ids) * block_size - 1
    logits = engine.position_logits(ids, tokens[position], position)
    return blocks, ValueDigest.of_logits(logits, position).encode()
