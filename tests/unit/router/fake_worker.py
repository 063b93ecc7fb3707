"""An in-process fake worker implementing `pdserve.protocol.worker_api`, for router tests.

It generates a fixed token script (`tokens[i]` for output token i), logs every call as
(path, request_id) in `calls` (and every sampling it was sent in `samplings`), and can be told
to refuse reservations (503), fail prefills (500, retryable or not) or fail generate. When the
sampling asks for logprobs, token i of a request seeded s gets `fake_logprob(s, i)` (prompt
logprobs likewise). Runs on an aiohttp TestServer on loopback, port 0. Like a real worker it
refuses control calls without the test cluster's signature (401/403).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.test_utils import TestServer
from cluster_auth import HTTP_KEY

from pdserve.auth.signing import CallVerifier
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker_api import (
    DecodeRequest,
    ErrorBody,
    GenerateRequest,
    KVEndpoint,
    LogprobModel,
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
from pdserve.worker.http.auth_middleware import auth_middleware
from pdserve.worker.http.error_status import error_middleware


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
    # This many /decode calls find their reservation gone (it expired while the prefill ran).
    expire_reservations_times: int = 0
    # Answer /health with 503 (a worker the router cannot use: partitioned, paused, restarting).
    down: bool = False
    # Why the last token (max_tokens) ends the stream: "length", or "stop" as an EOS would.
    finish_reason: str = "length"
    # Cut /decode and /generate streams (no finished event) after this many tokens.
    cut_after_tokens: int | None = None
    # End /decode and /generate streams with an engine error event (finish_reason "error", as
    # an engine reports a request it failed) after this many tokens, instead of finishing.
    error_after_tokens: int | None = None
    # Refuse this many reservations (503) before accepting.
    refuse_reserve_times: int = 0
    # Reservations (and the decodes they become) held at once; more are refused (503).
    capacity: int | None = None
    num_active: int = 0
    num_free_blocks: int = 100
    num_running: int = 0
    # The fingerprint it reports (None: the router harness fills in the router's model).
    fingerprint: dict[str, str | int | float] | None = None
    # When set, streamed token i carries a StepInfo whose prefill tokens are
    # `step_prefill_tokens[i % len]` (the worker's interference report); None: no step facts.
    step_prefill_tokens: list[int] | None = None
    calls: list[tuple[str, str]] = field(default_factory=list)
    samplings: list[SamplingParams] = field(default_factory=list)
    # Every /decode and /generate body, in order (checkpoint plans and sources included).
    bodies: list[DecodeRequest | GenerateRequest] = field(default_factory=list)
    # Reported as the prefix cache's share of every prompt.
    num_cached_tokens: int = 0
    reserved: dict[str, ReserveRequest] = field(default_factory=dict)
    server: TestServer | None = None
    verifier: CallVerifier = field(default_factory=lambda: CallVerifier(HTTP_KEY, time.time))

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    def paths(self) -> list[str]:
        """The call log's paths, /health excluded."""
        return [p for p, _ in self.calls if p != "/health"]

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[error_middleware(self.worker_id), auth_middleware(self.verifier)]
        )
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
        if self.down:
            return _error(503, "down", "Unavailable", retryable=True)
        body = WorkerHealth(
            worker_id=self.worker_id,
            role=self.role,  # type: ignore[arg-type]
            pid=0,
            fingerprint=self.fingerprint or {"arch": "tiny"},
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
        full = self.capacity is not None and self.num_active >= self.capacity
        if self.refuse_reserve or self.refuse_reserve_times > 0 or full:
            self.refuse_reserve_times -= 1
            return _error(503, "no free blocks", "NoCapacity", retryable=True)
        self.reserved[body.request_id] = body
        self.num_active += 1
        res = Reservation(
            request_id=body.request_id,
            transfer_id="00" * 16,
            capability_token="11" * 16,
            endpoints=[KVEndpoint(transport="tcp", address="127.0.0.1:1")],
            lease_epoch=1,
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
        self.samplings.append(body.sampling)
        if self.fail_prefill:
            return _error(500, "prefill blew up", "EngineError", self.fail_prefill_retryable)
        lp = _logprob(body.sampling, 0, self.tokens[0])
        result = PrefillResult(
            request_id=body.request_id,
            first_token_id=self.tokens[0],
            num_prompt_tokens=len(body.prompt_token_ids),
            num_cached_tokens=self.num_cached_tokens,
            prefill_start_ns=1,
            prefill_end_ns=2,
            first_logprobs=lp,
            prompt_logprobs=_prompt_logprobs(body.sampling, body.prompt_token_ids),
        )
        return _json(result)

    async def decode(self, request: web.Request) -> web.StreamResponse:
        body = DecodeRequest.model_validate_json(await request.read())
        self.calls.append(("/decode", body.request_id))
        self.bodies.append(body)
        reserved = self.reserved.pop(body.request_id, None)
        if reserved is not None and self.expire_reservations_times > 0:
            self.expire_reservations_times -= 1
            self.num_active -= 1
            reserved = None
        if reserved is None:
            return _error(404, "unknown request", "RequestNotFound")
        try:
            return await self._decode(request, reserved)
        finally:
            self.num_active -= 1

    async def _decode(self, request: web.Request, reserved: ReserveRequest) -> web.StreamResponse:
        if self.fail_kv_times > 0:
            self.fail_kv_times -= 1
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await resp.prepare(request)
            event = TokenEvent(
                token_ids=[],
                finished=True,
                finish_reason="error",
                error="KVNotReady: never came",
                error_type="KVNotReady",
            )
            await resp.write(event.model_dump_json().encode() + b"\n")
            await resp.write_eof()
            return resp
        return await self._stream(request, 1, reserved.sampling)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = GenerateRequest.model_validate_json(await request.read())
        self.calls.append(("/generate", body.request_id))
        self.bodies.append(body)
        self.samplings.append(body.sampling)
        if self.refuse_reserve:
            return _error(503, "full", "NoCapacity", retryable=True)
        # A resumed request continues after the tokens it already has.
        prompt = None if body.output_token_ids else body.prompt_token_ids
        return await self._stream(request, len(body.output_token_ids), body.sampling, prompt)

    async def release(self, request: web.Request) -> web.Response:
        body = ReleaseRequest.model_validate_json(await request.read())
        self.calls.append(("/release", body.request_id))
        freed = self.reserved.pop(body.request_id, None)
        if freed is not None:
            self.num_active -= 1
        return _json(ReleaseResult(request_id=body.request_id, num_freed_blocks=int(bool(freed))))

    async def _stream(
        self,
        request: web.Request,
        start: int,
        sampling: SamplingParams,
        prompt: list[int] | None = None,
    ) -> web.StreamResponse:
        max_tokens = sampling.max_tokens
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for i in range(start, max_tokens):
            if self.cut_after_tokens is not None and i - start >= self.cut_after_tokens:
                # A dead worker: the connection drops mid-stream, with no finished event.
                assert request.transport is not None
                request.transport.close()
                return resp
            if self.error_after_tokens is not None and i - start >= self.error_after_tokens:
                event = TokenEvent(token_ids=[], finished=True, finish_reason="error",
                                   error="engine step failed", error_type="EngineError")  # fmt: skip
                await resp.write(event.model_dump_json().encode() + b"\n")
                await resp.write_eof()
                return resp
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            last = i == max_tokens - 1
            token = self.tokens[i % len(self.tokens)]
            lp = _logprob(sampling, i, token)
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
                token_ids=[token],
                finished=last,
                finish_reason=self.finish_reason if last else None,
                logprobs=None if lp is None else [lp],
                prompt_logprobs=None
                if i != start or prompt is None
                else _prompt_logprobs(sampling, prompt),
                num_cached_tokens=self.num_cached_tokens if i == start else None,
                step=step,
            )
            await resp.write(event.model_dump_json().encode() + b"\n")
        await resp.write_eof()
        return resp


def fake_logprob(seed: int | None, index: int) -> float:
    """The logprob the fake gives output token `index` of a request seeded `seed`."""
    return -((seed or 0) % 7 + 1) * 0.1 - index * 0.01


def _logprob(sampling: SamplingParams, index: int, token: int) -> LogprobModel | None:
    if sampling.logprobs is None:
        return None
    value = fake_logprob(sampling.seed, index)
    top = [(token, value), (token + 1, value - 1.0), (token + 2, value - 2.0)]
    top = top[: sampling.logprobs]
    return LogprobModel(
        token_id=token,
        logprob=value,
        top_token_ids=[t for t, _ in top],
        top_logprobs=[v for _, v in top],
    )


def _prompt_logprobs(sampling: SamplingParams, prompt: list[int]) -> list[LogprobModel] | None:
    if sampling.prompt_logprobs is None:
        return None
    return [LogprobModel(token_id=t, logprob=-0.5) for t in prompt[1:]]


def _json(body: ReleaseResult | Reservation | PrefillResult | WorkerHealth) -> web.Response:
    return web.Response(text=body.model_dump_json(), content_type="application/json")


def _error(status: int, message: str, type_: str, retryable: bool = False) -> web.Response:
    body = ErrorBody(error=message, type=type_, retryable=retryable, worker_id="fake")
    return web.Response(text=body.model_dump_json(), status=status, content_type="application/json")
