"""The disaggregated request path: reserve on decode, prefill elsewhere, stream, decode.

    ROUTED(P, D)   policy picks a decode worker D and a prefill worker P with D's digest
    RESERVED       POST D/reserve; refused or unreachable → RETRYING → the next D; none → 503
    PREFILLING     POST P/prefill with the reservation (P pushes the KV to D afterwards)
    PREFILLED      the first token goes to the client at once
    TRANSFERRING   POST D/decode with first_token_id; D waits for verified KV
    COMMITTED, DECODING   D's first streamed line; tokens flow until D says finished
    FINISHED

Invariant 5 (reserve before prefill): `/prefill` is only ever called with a reservation this
flow obtained, so a refused reservation never wastes a prefill. A retryable prefill failure
(P died, P full) releases the reservation and starts over with a fresh one, skipping P, under a
worker-side request id suffixed with the attempt so the old one cannot collide.

Migration (invariant 4, exactly-once tokens): once tokens reached the client, a failing decode
side is replaced by a `both` worker that resumes after exactly those tokens (`/generate` with
`output_token_ids`); sampling is keyed by token index, so greedy and seeded text equal a run
without the fault. At most `max_migrations` workers are tried.

Whatever ends the stream early — an error, the client leaving, a stop string — the reservation
on D and any KV held on P are released before the generator finishes.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Collection, Sequence
from dataclasses import dataclass

from pdserve.errors import NoCapacity, RouterError, WorkerCallError, WorkerUnreachable
from pdserve.router.flow import FlowRequest, TokenChunk
from pdserve.router.policy import WorkerView, pick_prefill, rank_colocated, rank_decode
from pdserve.router.pool import WorkerPool
from pdserve.router.state import RequestState as S
from pdserve.router.worker_client import WorkerClient
from pdserve.worker.protocol import (
    DecodeRequest,
    ErrorBody,
    GenerateRequest,
    PrefillRequest,
    PrefillResult,
    Reservation,
    ReserveRequest,
)


@dataclass(frozen=True, slots=True)
class _Leg:
    """A reserved decode slot and the prefill worker chosen for it."""

    decode_url: str
    prefill_url: str
    worker_request_id: str
    reservation: Reservation


class DisaggFlow:
    """Runs requests across a prefill and a decode worker."""

    def __init__(
        self,
        pool: WorkerPool,
        client: WorkerClient,
        eos_token_ids: Sequence[int],
        max_prefill_attempts: int = 2,
        lease_ttl_s: float = 30.0,
        max_migrations: int = 2,
    ) -> None:
        self._pool = pool
        self._client = client
        self._eos_token_ids = frozenset(eos_token_ids)
        self._max_prefill_attempts = max_prefill_attempts
        self._lease_ttl_s = lease_ttl_s
        self._max_migrations = max_migrations

    async def stream(self, request: FlowRequest) -> AsyncGenerator[TokenChunk, None]:
        """The request's tokens: the prefill's first token, then the decode worker's stream.

        If the decode side fails after the first token (worker died, stream broken, KV never
        verified), the request migrates: a `both` worker resumes after the tokens the client
        already has, so each token reaches the client exactly once.
        """
        timeline = request.timeline
        leg, first = await self._prefill_with_retries(request)
        # Every token the client has been sent, in order: the resume point of a migration.
        sent: list[int] = []
        # True once nothing is held for the request on either worker any more.
        settled = False
        try:
            with self._pool.inflight(leg.decode_url):
                timeline.advance(S.PREFILLED, f"first_token={first.first_token_id}")
                finish = self._first_token_finishes(request, first.first_token_id)
                if finish is not None:
                    timeline.advance(S.FINISHED, f"first token: {finish}")
                    yield TokenChunk([first.first_token_id], finish)
                    return
                sent.append(first.first_token_id)
                yield TokenChunk([first.first_token_id])
                try:
                    async for chunk in self._decode(request, leg, first):
                        sent.extend(chunk.token_ids)
                        if chunk.finish_reason is not None:
                            settled = True
                        yield chunk
                        if settled:
                            return
                    raise WorkerUnreachable(leg.decode_url, "decode stream ended before finished")
                except RouterError as exc:
                    if not exc.retryable and not isinstance(exc, WorkerCallError):
                        raise
                    if isinstance(exc, WorkerUnreachable):
                        self._pool.mark_failed(leg.decode_url, str(exc))
                    await self._client.release_quietly(leg.decode_url, leg.worker_request_id)
                    await self._client.release_quietly(leg.prefill_url, leg.worker_request_id)
                    settled = True
                    timeline.advance(S.RETRYING, f"migrate after {len(sent)} tokens: {exc}")
            async for chunk in self._migrate(request, leg, sent):
                yield chunk
        except RouterError as exc:
            timeline.fail(str(exc))
            raise
        finally:
            if not settled:
                # Closed early, failed, or finished by the first token: D still holds the
                # reservation (or the sequence), P may hold KV awaiting transfer.
                await self._client.release_quietly(leg.decode_url, leg.worker_request_id)
                await self._client.release_quietly(leg.prefill_url, leg.worker_request_id)
            timeline.fail("closed before the worker finished")

    async def _decode(
        self, request: FlowRequest, leg: _Leg, first: PrefillResult
    ) -> AsyncGenerator[TokenChunk, None]:
        timeline = request.timeline
        timeline.advance(S.TRANSFERRING, leg.decode_url)
        decode = DecodeRequest(
            request_id=leg.worker_request_id, first_token_id=first.first_token_id
        )
        async with contextlib.aclosing(self._client.decode(leg.decode_url, decode)) as s:
            async for event in s:
                if timeline.state is S.TRANSFERRING:
                    timeline.advance(S.COMMITTED)
                if event.error is not None or event.finish_reason == "error":
                    raise _stream_error(leg.decode_url, event.error)
                if event.token_ids and timeline.state is S.COMMITTED:
                    timeline.advance(S.DECODING)
                if event.finished:
                    timeline.advance(S.FINISHED, event.finish_reason or "")
                    yield TokenChunk(event.token_ids, event.finish_reason or "stop")
                    return
                yield TokenChunk(event.token_ids)

    async def _migrate(
        self, request: FlowRequest, leg: _Leg, sent: list[int]
    ) -> AsyncGenerator[TokenChunk, None]:
        """Resume on another `both` worker after `sent`; each failure moves on, up to a budget."""
        timeline = request.timeline
        failed = {leg.decode_url}
        for n in range(1, self._max_migrations + 1):
            candidates = rank_colocated(self._pool.snapshot(), exclude=failed)
            if not candidates:
                raise NoCapacity(
                    f"no worker to migrate {request.request_id} to (failed {sorted(failed)})"
                )
            url = candidates[0].url
            rid = f"{leg.worker_request_id}.m{n}"
            timeline.advance(S.ROUTED, f"migrate to {url} after {len(sent)} tokens")
            body = GenerateRequest(
                request_id=rid,
                prompt_token_ids=request.prompt_token_ids,
                sampling=request.sampling,
                output_token_ids=list(sent),
            )
            finished = False
            try:
                with self._pool.inflight(url):
                    async with contextlib.aclosing(self._client.generate(url, body)) as s:
                        async for event in s:
                            if event.error is not None or event.finish_reason == "error":
                                raise _stream_error(url, event.error)
                            if timeline.state is S.ROUTED:
                                timeline.advance(S.DECODING, url)
                            sent.extend(event.token_ids)
                            if event.finished:
                                finished = True
                                timeline.advance(S.FINISHED, event.finish_reason or "")
                                yield TokenChunk(event.token_ids, event.finish_reason or "stop")
                                return
                            yield TokenChunk(event.token_ids)
                raise WorkerUnreachable(url, "stream ended before finished")
            except RouterError as exc:
                if isinstance(exc, WorkerUnreachable):
                    self._pool.mark_failed(url, str(exc))
                if n == self._max_migrations or not (
                    exc.retryable or isinstance(exc, WorkerCallError)
                ):
                    raise
                failed.add(url)
                timeline.advance(S.RETRYING, f"migration {n} failed: {exc}")
            finally:
                if not finished:
                    await self._client.release_quietly(url, rid)
        raise NoCapacity(f"request {request.request_id}: migrations exhausted")

    def _first_token_finishes(self, request: FlowRequest, token_id: int) -> str | None:
        sampling = request.sampling
        if token_id in sampling.stop_token_ids or (
            not sampling.ignore_eos and token_id in self._eos_token_ids
        ):
            return "stop"
        return "length" if sampling.max_tokens <= 1 else None

    async def _prefill_with_retries(self, request: FlowRequest) -> tuple[_Leg, PrefillResult]:
        timeline = request.timeline
        skip_prefill: set[str] = set()
        for attempt in range(self._max_prefill_attempts):
            rid = request.request_id if attempt == 0 else f"{request.request_id}.a{attempt}"
            leg = await self._route_and_reserve(request, rid, skip_prefill)
            try:
                timeline.advance(S.PREFILLING, leg.prefill_url)
                prefill = PrefillRequest(
                    request_id=rid,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling=request.sampling,
                    reservation=leg.reservation,
                    lease_ttl_s=self._lease_ttl_s,
                )
                with self._pool.inflight(leg.prefill_url):
                    return leg, await self._client.prefill(leg.prefill_url, prefill)
            except BaseException as exc:
                await self._client.release_quietly(leg.decode_url, rid)
                await self._client.release_quietly(leg.prefill_url, rid)
                last = attempt + 1 == self._max_prefill_attempts
                if not isinstance(exc, RouterError) or not exc.retryable or last:
                    timeline.fail(str(exc) or type(exc).__name__)
                    raise
                if isinstance(exc, WorkerUnreachable):
                    self._pool.mark_failed(leg.prefill_url, str(exc))
                skip_prefill.add(leg.prefill_url)
                timeline.advance(S.RETRYING, str(exc))
        raise AssertionError("unreachable: the last attempt re-raises")

    async def _route_and_reserve(
        self, request: FlowRequest, rid: str, skip_prefill: Collection[str]
    ) -> _Leg:
        """Reserve on the best decode worker that has a prefill partner; next one on refusal."""
        timeline = request.timeline
        tried: set[str] = set()
        while True:
            pair = _pick_pair(self._pool.snapshot(), tried, skip_prefill)
            if pair is None:
                exc = NoCapacity(
                    f"no decode worker with a compatible prefill worker accepted {rid}"
                    f" (tried {sorted(tried)})"
                )
                timeline.fail(str(exc))
                raise exc
            decode, prefill = pair
            timeline.advance(S.ROUTED, f"decode={decode.url} prefill={prefill.url}")
            try:
                reservation = await self._client.reserve(
                    decode.url,
                    ReserveRequest(
                        request_id=rid,
                        prompt_token_ids=request.prompt_token_ids,
                        sampling=request.sampling,
                        lease_ttl_s=self._lease_ttl_s,
                    ),
                )
            except RouterError as exc:
                if not exc.retryable:
                    timeline.fail(str(exc))
                    raise
                if isinstance(exc, WorkerUnreachable):
                    self._pool.mark_failed(decode.url, str(exc))
                tried.add(decode.url)
                timeline.advance(S.RETRYING, str(exc))
                continue
            timeline.advance(S.RESERVED, reservation.transfer_id)
            return _Leg(decode.url, prefill.url, rid, reservation)


def _pick_pair(
    views: Sequence[WorkerView], tried: Collection[str], skip_prefill: Collection[str]
) -> tuple[WorkerView, WorkerView] | None:
    for decode in rank_decode(views, exclude=tried):
        prefill = pick_prefill(views, decode, exclude=skip_prefill)
        if prefill is not None:
            return decode, prefill
    return None


def _stream_error(url: str, detail: str | None) -> WorkerCallError:
    return WorkerCallError(url, 500, ErrorBody(error=detail or "stream failed", type="StreamError"))
