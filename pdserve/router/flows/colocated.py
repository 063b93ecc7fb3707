"""The colocated request path: the whole request on one `both` worker via POST /generate.

    ROUTED(W) → DECODING (W's first streamed line: prefill and the first token happened there)
      → FINISHED

Until W sends its first line nothing reached the client, so a retryable failure there (W full:
503, W unreachable) moves to RETRYING and the next worker is tried; none left (or none up) →
the capacity queue, woken when room frees or a worker answers again, then every worker once
more; the queue's time up → NoCapacity.
After the first line a failure ends the request. Closing the stream early releases the request
on W. W is chosen by the affinity policy among `both` workers (cached prefix, session, load),
and a finished request is recorded there, so conversations stay on their worker.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace

from pdserve.errors import NoCapacity, RouterError, WorkerCallError, WorkerUnreachable
from pdserve.protocol.request_state import Reason
from pdserve.protocol.request_state import RequestState as S
from pdserve.protocol.worker_api import ErrorBody, GenerateRequest, TokenEvent
from pdserve.router.config import AffinityConfig
from pdserve.router.flows import progress
from pdserve.router.flows.capacity_queue import CapacityQueue
from pdserve.router.flows.flow import FlowRequest, TokenChunk
from pdserve.router.placement.affinity import AffinityPolicy, RouteQuery
from pdserve.router.workers.client import WorkerClient
from pdserve.router.workers.pool import WorkerPool


class ColocatedFlow:
    """Runs each request entirely on one worker of role `both`."""

    def __init__(
        self,
        pool: WorkerPool,
        client: WorkerClient,
        affinity: AffinityPolicy | None = None,
        on_end: Callable[[], None] | None = None,
        queue: CapacityQueue | None = None,
        queue_timeout_s: float = 0.0,
    ) -> None:
        self._pool = pool
        self._client = client
        self._queue = queue
        self._queue_timeout_s = queue_timeout_s
        # Told when a request ends (its blocks are free again: the capacity queue listens).
        self._on_end = on_end
        # Placement (shared with the disaggregated flow, so a conversation keeps its worker
        # across a mode switch); without one, plain least-load.
        self._affinity = affinity or AffinityPolicy(AffinityConfig(routing="load"))

    async def stream(self, request: FlowRequest) -> AsyncGenerator[TokenChunk, None]:
        """The request's tokens as the worker streams them."""
        try:
            async with contextlib.aclosing(self._stream(request)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            if self._on_end is not None:
                self._on_end()

    async def _wait(self, detail: str, deadline: float) -> bool:
        """Wait in the capacity queue for room or a worker back; False once `deadline` passed
        (or there is no queue)."""
        if self._queue is None or asyncio.get_running_loop().time() >= deadline:
            return False
        async with self._queue.join(detail) as waiter:
            try:
                await waiter.next_chance(deadline)
            except TimeoutError:
                return False
        return True

    async def _stream(self, request: FlowRequest) -> AsyncGenerator[TokenChunk, None]:
        timeline = request.timeline
        tried: set[str] = set()
        query = RouteQuery(
            request.prompt_token_ids,
            request.sampling.max_tokens,
            request.session_id,
            self._affinity.next_ticket(),
        )
        output: list[int] = []
        queue_deadline = asyncio.get_running_loop().time() + self._queue_timeout_s
        while True:
            ranked = self._affinity.rank_colocated(self._pool.snapshot(), query, exclude=tried)
            if not ranked:
                detail = f"no colocated (role both) worker accepted {request.request_id}"
                if await self._wait(detail, min(queue_deadline, request.deadline)):
                    tried.clear()
                    continue
                exc = NoCapacity(
                    f"{detail}; waited {self._queue_timeout_s} s in the queue", tried=tried
                )
                progress.failed(timeline, str(exc))
                raise exc
            url = ranked[0].url
            progress.routed(timeline, url)
            body = GenerateRequest(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling=request.sampling,
                deadline_s=request.remaining_s(),
            )
            settled = False
            with self._pool.inflight(url):
                try:
                    async with contextlib.aclosing(self._client.generate(url, body)) as events:
                        try:
                            first = await anext(events)
                        except StopAsyncIteration:
                            raise WorkerUnreachable(url, "generate stream was empty") from None
                        except RouterError as exc:
                            if not exc.retryable:
                                raise
                            settled = True  # nothing was admitted there
                            if isinstance(exc, WorkerUnreachable):
                                self._pool.mark_failed(url, str(exc))
                            tried.add(url)
                            progress.retrying(timeline, Reason.WORKER_REFUSED, str(exc))
                            continue
                        progress.decoding(timeline)
                        event: TokenEvent | None = first
                        while event is not None:
                            output.extend(event.token_ids)
                            if query.revision is None and output:
                                # What the client has came from this revision: so must the rest.
                                query = replace(query, revision=self._pool.digest_of(url))
                            if event.error is not None or event.finish_reason == "error":
                                kind = event.error_type or "StreamError"
                                raise WorkerCallError(
                                    url, 500, ErrorBody(error=event.error or "failed", type=kind)
                                )
                            if event.finished:
                                settled = True
                                yield progress.finished_by_worker(timeline, event)
                                return
                            yield TokenChunk.of_event(event)
                            event = await anext(events, None)
                        raise WorkerUnreachable(url, "generate stream ended before finished")
                except RouterError as exc:
                    progress.failed(timeline, str(exc))
                    raise
                finally:
                    if not settled:
                        # Recorded first: a cancel (the client hung up) may land in the release.
                        progress.failed(timeline, "closed before the worker finished")
                        await self._client.release_quietly(url, request.request_id)
                    if timeline.state is S.FINISHED:
                        self._affinity.record(
                            self._pool.snapshot(),
                            url,
                            None,
                            request.prompt_token_ids,
                            output,
                            request.session_id,
                        )
