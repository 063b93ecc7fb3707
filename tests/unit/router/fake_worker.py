"""An in-process fake worker implementing `pdserve.worker.protocol`, for router tests.

It generates a fixed token script (`tokens[i]` for output token i), logs every call as
(path, request_id) in `calls`, and can be told to refuse reservations (503), fail prefills
(500, retryable or not) or fail generate. Runs on an aiohttp TestServer on loopback, port 0.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.test_utils import TestServer

from pdserve.worker.protocol import (
    DecodeRequest,
    ErrorBody,
    GenerateRequest,
    PrefillRequest,
    PrefillResult,
    ReleaseRequest,
    ReleaseResult,
    RenewRequest,
    RenewResult,
    Reservation,
    ReserveRequest,
    StepInfo,
    TokenEvent,
    WorkerHealth,
)


@dataclass(slots=True)
class FakeWorker:
    """One fake worker's behaviour and call log."""

    role: str
    tokens: list[int]
    digest: str = "fp-A"
    worker_id: str = "fake"
    refuse_reserve: bool = False
    fail_prefill: bool = False
    fail_prefill_retryable: bool = True
    # Seconds to wait between streamed tokens (lets a test disconnect mid-stream).
    token_delay_s: float = 0.0
    # Seconds a prefill takes (a queued or long prefill).
    prefill_delay_s: float = 0.0
    # This many /decode calls report that the KV never verified, before any token.
    fail_kv_times: int = 0
    # Cut /decode and /generate streams (no finished event) after this many tokens.
    cut_after_tokens: int | None = None
    # Refuse this many reservations (503) before accepting.
    refuse_reserve_times: int = 0
    num_free_blocks: int = 100
    num_running: int = 0
    # When set, streamed token i carries a StepInfo whose prefill tokens are
    # `step_prefill_tokens[i % len]` (the worker's interference report); None: no step facts.
    step_prefill_tokens: list[int] | None = None
    calls: list[tuple[str, str]] = field(default_factory=list)
    reserved: dict[str, ReserveRequest] = field(default_factory=dict)
    server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    def paths(self) -> list[str]:
        """The call log's paths, /health excluded."""
        return [p for p, _ in self.calls if p != "/health"]

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_post("/reserve", self.reserve)
        app.router.add_post("/prefill", self.prefill)
        app.router.add_post("/decode", self.decode)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/release", self.release)
        app.router.add_post("/renew", self.renew)
        return app

    async def start(self) -> FakeWorker:
        self.server = TestServer(self.app(), host="127.0.0.1", port=0)
        await self.server.start_server()
        return self

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()

    async def health(self, request: web.Request) -> web.Response:
        self.calls.append(("/health", ""))
        body = WorkerHealth(
            worker_id=self.worker_id,
            role=self.role,  # type: ignore[arg-type]
            pid=0,
            fingerprint={"arch": "tiny"},
            fingerprint_digest=self.digest,
            transfer_address="127.0.0.1:1" if self.role != "prefill" else None,
            max_model_len=256,
            block_size=16,
            num_blocks=100,
            num_free_blocks=self.num_free_blocks,
            num_pinned_blocks=len(self.reserved),
            num_running=self.num_running,
            num_waiting=0,
            num_active_leases=len(self.reserved),
        )
        return _json(body)

    async def reserve(self, request: web.Request) -> web.Response:
        body = ReserveRequest.model_validate_json(await request.read())
        self.calls.append(("/reserve", body.request_id))
        if self.refuse_reserve or self.refuse_reserve_times > 0:
            self.refuse_reserve_times -= 1
            return _error(503, "no free blocks", "NoCapacity", retryable=True)
        self.reserved[body.request_id] = body
        res = Reservation(
            request_id=body.request_id,
            transfer_id="00" * 16,
            capability_token="11" * 16,
            transfer_address="127.0.0.1:1",
            num_cached_tokens=0,
            lease_ttl_s=body.lease_ttl_s,
        )
        return _json(res)

    async def renew(self, request: web.Request) -> web.Response:
        body = RenewRequest.model_validate_json(await request.read())
        self.calls.append(("/renew", body.request_id))
        if body.request_id not in self.reserved:
            return _error(404, "no reservation", "RequestNotFound")
        ttl = self.reserved[body.request_id].lease_ttl_s
        return _json(RenewResult(request_id=body.request_id, lease_ttl_s=ttl))

    async def prefill(self, request: web.Request) -> web.Response:
        body = PrefillRequest.model_validate_json(await request.read())
        self.calls.append(("/prefill", body.request_id))
        await asyncio.sleep(self.prefill_delay_s)
        if self.fail_prefill:
            return _error(500, "prefill blew up", "EngineError", self.fail_prefill_retryable)
        result = PrefillResult(
            request_id=body.request_id,
            first_token_id=self.tokens[0],
            num_prompt_tokens=len(body.prompt_token_ids),
            num_cached_tokens=0,
            prefill_start_ns=1,
            prefill_end_ns=2,
        )
        return _json(result)

    async def decode(self, request: web.Request) -> web.StreamResponse:
        body = DecodeRequest.model_validate_json(await request.read())
        self.calls.append(("/decode", body.request_id))
        reserved = self.reserved.pop(body.request_id, None)
        if reserved is None:
            return _error(404, "unknown request", "RequestNotFound")
        if self.fail_kv_times > 0:
            self.fail_kv_times -= 1
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await resp.prepare(request)
            event = TokenEvent(
                token_ids=[], finished=True, finish_reason="error", error="KVNotReady: never came"
            )
            await resp.write(event.model_dump_json().encode() + b"\n")
            await resp.write_eof()
            return resp
        return await self._stream(request, 1, reserved.sampling.max_tokens)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = GenerateRequest.model_validate_json(await request.read())
        self.calls.append(("/generate", body.request_id))
        if self.refuse_reserve:
            return _error(503, "full", "NoCapacity", retryable=True)
        # A resumed request continues after the tokens it already has.
        return await self._stream(request, len(body.output_token_ids), body.sampling.max_tokens)

    async def release(self, request: web.Request) -> web.Response:
        body = ReleaseRequest.model_validate_json(await request.read())
        self.calls.append(("/release", body.request_id))
        freed = self.reserved.pop(body.request_id, None)
        return _json(ReleaseResult(request_id=body.request_id, num_freed_blocks=int(bool(freed))))

    async def _stream(
        self, request: web.Request, start: int, max_tokens: int
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for i in range(start, max_tokens):
            if self.cut_after_tokens is not None and i - start >= self.cut_after_tokens:
                # A dead worker: the connection drops mid-stream, with no finished event.
                assert request.transport is not None
                request.transport.close()
                return resp
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            last = i == max_tokens - 1
            step = None
            if self.step_prefill_tokens is not None:
                prefill = self.step_prefill_tokens[i % len(self.step_prefill_tokens)]
                step = StepInfo(
                    index=i,
                    duration_s=0.001,
                    num_prefill_tokens=prefill,
                    num_decode_tokens=1,
                    # Token 0 of a /generate stream comes from its own prefill.
                    decode=i > 0,
                )
            event = TokenEvent(
                token_ids=[self.tokens[i % len(self.tokens)]],
                finished=last,
                finish_reason="length" if last else None,
                step=step,
            )
            await resp.write(event.model_dump_json().encode() + b"\n")
        await resp.write_eof()
        return resp


def _json(body: ReleaseResult | Reservation | PrefillResult | WorkerHealth) -> web.Response:
    return web.Response(text=body.model_dump_json(), content_type="application/json")


def _error(status: int, message: str, type_: str, retryable: bool = False) -> web.Response:
    body = ErrorBody(error=message, type=type_, retryable=retryable, worker_id="fake")
    return web.Response(text=body.model_dump_json(), status=status, content_type="application/json")
