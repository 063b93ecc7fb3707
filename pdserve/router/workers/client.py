"""Typed client for the worker control API (`pdserve.protocol.worker_api`), over one session.

Every call takes and returns protocol models; nothing untyped crosses this boundary, and every
call carries the cluster credential (`X-Pdserve-Auth`, signed with the "http" key). Unary calls
run under a total timeout (never past the request's deadline when the caller gives the time it
has left); streams (`decode`, `generate`) under a per-read timeout instead, since a long
generation is legitimately long but a silent worker is not. A non-2xx answer
raises `WorkerCallError` carrying the worker's `ErrorBody`; a connection failure or timeout
raises `WorkerUnreachable`. Streams are async generators: close them (`contextlib.aclosing`)
to drop the HTTP connection, which is how the router abandons a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from pydantic import BaseModel, ValidationError

from pdserve.auth.signing import auth_headers, call_target
from pdserve.errors import RouterError, WorkerCallError, WorkerUnreachable
from pdserve.protocol.worker_api import (
    DecodeRequest,
    ErrorBody,
    GenerateRequest,
    PrefillRequest,
    PrefillResult,
    ProbeExpectRequest,
    ProbeResult,
    ProbeSendRequest,
    ReleaseRequest,
    ReleaseResult,
    RenewRequest,
    RenewResult,
    Reservation,
    ReserveRequest,
    TokenEvent,
    WorkerHealth,
)
from pdserve.protocol.worker_observe import (
    FaultPlanBody,
    FaultState,
    KVEventBatch,
    KVEventsRequest,
    WorkerEvents,
)

_M = TypeVar("_M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class ClientTimeouts:
    """Seconds allowed per call kind."""

    health_s: float = 2.0
    # Opening a connection, for every call (streams have no total deadline of their own).
    connect_s: float = 5.0
    control_s: float = 10.0
    # Prefill of a long prompt on CPU can take a while.
    prefill_s: float = 120.0
    # Longest silence between two lines of a token stream.
    stream_read_s: float = 120.0


class WorkerClient:
    """Calls workers by base URL ("http://127.0.0.1:PORT") over a shared ClientSession."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        timeouts: ClientTimeouts,
        key: bytes | None = None,
    ) -> None:
        """`key` signs every call (the cluster secret's "http" key; None: an insecure cluster)."""
        self._session = session
        self._timeouts = timeouts
        self._key = key
        # Cleanup releases in flight; held so they are not garbage-collected mid-call.
        self._cleanups: set[asyncio.Task[None]] = set()
        # Token streams and control calls open per worker URL, so `abandon` can cut them.
        self._streams: dict[str, set[aiohttp.ClientResponse]] = {}
        self._calls: dict[str, set[asyncio.Future[Any]]] = {}
        # worker URL -> `<worker id>/<instance id>` its calls are signed for (the pool sets it
        # from each /health): a call can then only land on the life of the worker it was
        # meant for, never on a process restarted at the same address.
        self._targets: dict[str, str] = {}

    def set_target(self, url: str, worker_id: str, instance_id: str) -> bool:
        """Sign calls to `url` for this life of the worker; True when it is a new instance
        (the worker restarted since its last /health: the caller drops what it held there)."""
        target = call_target(worker_id, instance_id)
        before = self._targets.get(url)
        self._targets[url] = target
        return before is not None and before != target

    def forget_target(self, url: str) -> None:
        """The worker left the pool: its next life starts unknown."""
        self._targets.pop(url, None)

    def abandon(self, url: str) -> int:
        """Cut every open token stream and control call to `url` (it left the pool); returns
        how many.

        A worker that went silent (a partition, a lapsed membership lease) never answers or
        closes; without this each call would wait out its own timeout (10 s for a control
        call, 120 s of stream silence) before failing over. A cut stream fails as any broken
        stream does and a cut call raises WorkerUnreachable: the flows' recovery takes over.
        """
        streams = self._streams.pop(url, set())
        for resp in streams:
            resp.close()
        calls = self._calls.pop(url, set())
        for call in calls:
            call.cancel()
        return len(streams) + len(calls)

    async def _abandonable(self, url: str, coro: Coroutine[Any, Any, _M]) -> _M:
        """Await `coro` as a call `abandon(url)` can cut (then WorkerUnreachable)."""
        call = asyncio.ensure_future(coro)
        calls = self._calls.setdefault(url, set())
        calls.add(call)
        try:
            return await call
        except asyncio.CancelledError:
            task = asyncio.current_task()
            # Cut by `abandon`, not our own caller being cancelled: a failed call.
            if call.cancelled() and task is not None and task.cancelling() == 0:
                raise WorkerUnreachable(url, "left the pool while the call was open") from None
            raise
        finally:
            calls.discard(call)
            if not calls and self._calls.get(url) is calls:
                del self._calls[url]

    async def health(self, url: str, timeout_s: float | None = None) -> WorkerHealth:
        """GET /health (within `timeout_s`, else the health timeout)."""
        limit = self._timeouts.health_s if timeout_s is None else timeout_s
        return await self._get(url, "/health", WorkerHealth, limit)

    async def debug_events(self, url: str, request_id: str) -> WorkerEvents:
        """GET /debug/requests/{id}: the worker's timeline events for a router request."""
        path = f"/debug/requests/{request_id}"
        return await self._get(url, path, WorkerEvents, self._timeouts.health_s)

    async def faults(self, url: str) -> FaultState:
        """GET /admin/faults (tests and chaos runs: workers started with --enable-fault-admin)."""
        return await self._get(url, "/admin/faults", FaultState, self._timeouts.health_s)

    async def set_faults(self, url: str, plan: FaultPlanBody) -> FaultState:
        """POST /admin/faults: replace the worker's fault plan (no rules: clear it)."""
        return await self._post(url, "/admin/faults", plan, FaultState, self._timeouts.control_s)

    async def reserve(
        self, url: str, request: ReserveRequest, remaining_s: float | None = None
    ) -> Reservation:
        """POST /reserve: a decode slot and blocks for a transfer."""
        timeout = _within(self._timeouts.control_s, remaining_s)
        return await self._post(url, "/reserve", request, Reservation, timeout)

    async def prefill(
        self, url: str, request: PrefillRequest, remaining_s: float | None = None
    ) -> PrefillResult:
        """POST /prefill: the first token; the KV goes to the reservation afterwards."""
        timeout = _within(self._timeouts.prefill_s, remaining_s)
        return await self._post(url, "/prefill", request, PrefillResult, timeout)

    async def probe_expect(self, url: str, request: ProbeExpectRequest) -> Reservation:
        """POST /kv_probe/expect: a decode worker takes throwaway KV (the pair probe)."""
        return await self._post(
            url, "/kv_probe/expect", request, Reservation, self._timeouts.control_s
        )

    async def probe_send(self, url: str, request: ProbeSendRequest) -> ProbeResult:
        """POST /kv_probe/send: a prefill worker sends throwaway KV, timed."""
        return await self._post(
            url, "/kv_probe/send", request, ProbeResult, self._timeouts.prefill_s
        )

    async def renew(self, url: str, request: RenewRequest) -> RenewResult:
        """POST /renew: extend a reservation's lease while its prefill runs."""
        return await self._post(url, "/renew", request, RenewResult, self._timeouts.control_s)

    async def release(self, url: str, request: ReleaseRequest) -> ReleaseResult:
        """POST /release: free whatever the worker holds for the request."""
        return await self._post(url, "/release", request, ReleaseResult, self._timeouts.control_s)

    async def release_quietly(self, url: str, request_id: str, *more_urls: str) -> None:
        """Release on cleanup paths, on `url` and `more_urls` at once: never raises a
        RouterError, and every release completes even if the caller is cancelled meanwhile (a
        vanished client must not leak a reservation, nor a cancel skip the second worker)."""
        tasks = [self._release_task(u, request_id) for u in (url, *more_urls)]
        await asyncio.shield(asyncio.gather(*tasks))

    def release_in_background(self, url: str, request_id: str) -> None:
        """Release on a failure path without waiting for it: a paused or dead worker must not
        hold up the recovery by a control timeout (its own leases free what it held)."""
        self._release_task(url, request_id)

    def _release_task(self, url: str, request_id: str) -> asyncio.Task[None]:
        # Held until done, so a release is never garbage-collected mid-call.
        task = asyncio.create_task(self._release_ignoring_errors(url, request_id))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        return task

    async def _release_ignoring_errors(self, url: str, request_id: str) -> None:
        # 404 (already finished or freed) is the common, harmless answer here.
        with contextlib.suppress(RouterError):
            await self.release(url, ReleaseRequest(request_id=request_id))

    def decode(self, url: str, request: DecodeRequest) -> AsyncGenerator[TokenEvent, None]:
        """POST /decode: the token stream from the second token on."""
        return self._stream(url, "/decode", request, TokenEvent)

    def generate(self, url: str, request: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        """POST /generate: the whole request's token stream (colocated)."""
        return self._stream(url, "/generate", request, TokenEvent)

    def kv_events(self, url: str, request: KVEventsRequest) -> AsyncGenerator[KVEventBatch, None]:
        """POST /kv_events: the worker's prefix-cache events (a snapshot, then each change)."""
        return self._stream(url, "/kv_events", request, KVEventBatch)

    async def _get(self, url: str, path: str, model: type[_M], timeout_s: float) -> _M:
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self._timeouts.connect_s)
        headers = auth_headers(self._key, "GET", path, b"", self._targets.get(url))
        try:
            async with self._session.get(url + path, timeout=timeout, headers=headers) as resp:
                return await _parse(url, resp, model)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise WorkerUnreachable(url, f"GET {path}: {exc!r}") from exc

    async def _post(
        self, url: str, path: str, body: BaseModel, model: type[_M], timeout_s: float
    ) -> _M:
        return await self._abandonable(url, self._post_once(url, path, body, model, timeout_s))

    def _signed(self, url: str, path: str, body: BaseModel) -> tuple[bytes, dict[str, str]]:
        """A POST's body and headers, signed for the cluster and the worker's current life."""
        data = body.model_dump_json().encode()
        headers = {"Content-Type": "application/json"}
        headers.update(auth_headers(self._key, "POST", path, data, self._targets.get(url)))
        return data, headers

    async def _post_once(
        self, url: str, path: str, body: BaseModel, model: type[_M], timeout_s: float
    ) -> _M:
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self._timeouts.connect_s)
        data, headers = self._signed(url, path, body)
        try:
            async with self._session.post(
                url + path, data=data, headers=headers, timeout=timeout
            ) as resp:
                return await _parse(url, resp, model)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise WorkerUnreachable(url, f"POST {path}: {exc!r}") from exc

    async def _stream(
        self, url: str, path: str, body: BaseModel, model: type[_M]
    ) -> AsyncGenerator[_M, None]:
        timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=self._timeouts.connect_s,
            sock_read=self._timeouts.stream_read_s,
        )
        data, headers = self._signed(url, path, body)
        try:
            async with self._session.post(
                url + path, data=data, headers=headers, timeout=timeout
            ) as resp:
                if resp.status >= 300:
                    await _raise_error(url, resp)
                open_streams = self._streams.setdefault(url, set())
                open_streams.add(resp)
                try:
                    async for line in _lines(resp):
                        yield _validate(url, model, line)
                finally:
                    open_streams.discard(resp)
                    if not open_streams and self._streams.get(url) is open_streams:
                        del self._streams[url]
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise WorkerUnreachable(url, f"POST {path} stream: {exc!r}") from exc


def _within(timeout_s: float, remaining_s: float | None) -> float:
    """A call's timeout, never past the request's deadline."""
    return timeout_s if remaining_s is None else max(min(timeout_s, remaining_s), 0.001)


async def _lines(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    # readline() splits on b"\n" and buffers across chunk borders; blank lines are keep-alives.
    while True:
        line = await resp.content.readline()
        if not line:
            return
        line = line.strip()
        if line:
            yield line


async def _parse(url: str, resp: aiohttp.ClientResponse, model: type[_M]) -> _M:
    if resp.status >= 300:
        await _raise_error(url, resp)
    return _validate(url, model, await resp.read())


async def _raise_error(url: str, resp: aiohttp.ClientResponse) -> None:
    raw = await resp.read()
    try:
        body = ErrorBody.model_validate_json(raw)
    except ValidationError:
        # Not our worker's error shape (a proxy, a crash page): keep the status and the text.
        body = ErrorBody(error=raw[:500].decode("utf-8", "replace"), type="HTTPError")
    raise WorkerCallError(url, resp.status, body)


def _validate(url: str, model: type[_M], raw: bytes) -> _M:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        body = ErrorBody(error=f"invalid {model.__name__}: {exc}", type="ProtocolError")
        raise WorkerCallError(url, 502, body) from exc
