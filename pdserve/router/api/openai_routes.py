"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

A request goes: JSON → `RequestBuilder` (fields screened, pydantic model, model name, prompts
as token ids, sampling ranges, structured output compiled, context length; each failure an
`InvalidRequest` naming the OpenAI `param`) → one flow per sample (`fanout`: n, best_of, lists
of prompts), each chosen by the dispatcher → `OutputStream` per choice (detokenization, stop
strings, max_tokens) → one JSON body, or SSE chunks ending in `data: [DONE]`.

A streamed response's headers are sent only after the first token arrives, so "no capacity"
and worker-side refusals are still proper HTTP statuses; anything that fails after that (a
worker fault, the request's deadline) is sent as a final `data: {"error": ...}` event followed
by `data: [DONE]` and a clean end of stream, never a status line written into the body. A
client that disconnects (streaming or not) cancels its handler, and closing the flows releases
what the workers hold. Every request has one deadline (`--request-timeout-s`) that bounds it
end to end and that every worker call is told about.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator

from aiohttp import web
from pydantic import BaseModel

from pdserve.errors import NoCapacity, PdserveError, WorkerCallError
from pdserve.model.tokenizer import Tokenizer
from pdserve.observability.phases import handoff_phases
from pdserve.observability.spikes import SpikeDetector
from pdserve.router.api import fanout, responses, sse
from pdserve.router.api.fanout import ChoiceRun, Piece
from pdserve.router.api.json_body import read_object
from pdserve.router.api.logprobs_format import TokenTexts
from pdserve.router.api.openai_models import ChatDelta, ModelCard, ModelList
from pdserve.router.api.request_builder import BuilderConfig, RequestBuilder
from pdserve.router.api.responses import Job, error_body
from pdserve.router.config import RouterConfig
from pdserve.router.flows import progress
from pdserve.router.flows.dispatcher import Dispatcher
from pdserve.router.metrics import RouterMetrics
from pdserve.tools.formats import FORMATS

log = logging.getLogger(__name__)


class OpenAIApi:
    """Handlers of the OpenAI routes."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Tokenizer,
        max_model_len: int,
        dispatcher: Dispatcher,
        metrics: RouterMetrics,
    ) -> None:
        self._config = config
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._builder = RequestBuilder(
            BuilderConfig(
                model_names=config.accepted_model_names,
                max_model_len=max_model_len,
                allow_unknown_fields=config.allow_unknown_fields,
                tool_format=FORMATS[config.tool_call_parser],
            ),
            tokenizer,
        )
        self._texts = TokenTexts(tokenizer)
        self._created = int(time.time())
        # Baselines of handoff phases; a finished request far over one is logged and counted.
        self.spikes = SpikeDetector()

    def add_routes(self, app: web.Application) -> None:
        """Register the /v1 routes on `app`."""
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the served model, under each of its names."""
        cards = [
            ModelCard(id=name, created=self._created, max_model_len=self._max_model_len)
            for name in (self._config.served_model_names or (self._config.model_name,))
        ]
        return _json(ModelList(data=cards))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        job = self._builder.completion(await read_object(request))
        return await self._serve(request, job)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions (prompt from the chat template)."""
        job = self._builder.chat(await read_object(request))
        return await self._serve(request, job)

    async def _serve(self, request: web.Request, job: Job) -> web.StreamResponse:
        session_id = request.headers.get("x-session-id") or job.body.user
        deadline = asyncio.get_running_loop().time() + self._config.request_timeout_s
        runs = fanout.start(job, self._dispatcher, self._tokenizer, session_id, deadline)
        mode = runs[0].timeline.mode
        status = "error"
        try:
            async with contextlib.aclosing(fanout.pieces(runs)) as pieces:
                if job.body.stream:
                    resp, status = await self._stream(request, job, pieces, runs, deadline)
                else:
                    async with asyncio.timeout_at(deadline):
                        async for _ in pieces:
                            pass  # each choice accumulates its own result
                    chosen = fanout.returned(job, runs)
                    resp = _json(responses.whole(job, chosen, self._texts))
                    status = "ok"
            return resp
        except NoCapacity:
            status = "no_capacity"
            raise
        except WorkerCallError as exc:
            status = "client_error" if exc.status == 400 else "error"
            raise
        except TimeoutError:
            for run in runs:
                progress.failed(
                    run.timeline, f"request timeout ({self._config.request_timeout_s} s)"
                )
            status = "timeout"
            raise
        except (ConnectionResetError, asyncio.CancelledError):
            status = "cancelled"  # the client went away: the flows were closed, holds released
            for run in runs:
                progress.failed(run.timeline, "client disconnected")
            raise
        finally:
            self._metrics.count_request(mode, status)
            if status == "ok" and mode == "disagg":
                for run in runs:
                    phases = handoff_phases(run.timeline.history)
                    for spike in self.spikes.observe(run.request.request_id, phases):
                        log.warning("%s", spike.describe())

    async def _stream(
        self,
        request: web.Request,
        job: Job,
        pieces: AsyncGenerator[Piece, None],
        runs: list[ChoiceRun],
        deadline: float,
    ) -> tuple[web.StreamResponse, str]:
        """The SSE response and the request's status for the metrics."""
        # Wait for the first token before committing to a 200, so early errors keep a status.
        async with asyncio.timeout_at(deadline):
            first = await anext(pieces)
        resp = web.StreamResponse(headers={"Content-Type": sse.CONTENT_TYPE})
        await resp.prepare(request)
        results = {run.result.index: run.result for run in runs}
        opened: set[int] = set()
        piece: Piece | None = first
        status = "ok"
        try:
            while piece is not None:
                if piece.index not in opened:
                    opened.add(piece.index)
                    for body in self._opening(job, results[piece.index]):
                        await resp.write(sse.encode_event(body))
                if (
                    piece.text
                    or piece.tool_calls
                    or piece.finish_reason is not None
                    or (job.body.return_token_ids and piece.token_ids)
                    or (job.top_logprobs is not None and piece.token_ids)
                ):
                    lp = responses.output_logprobs(
                        job, self._texts, piece.token_ids, piece.logprobs,
                        [len(self._echo_prefix(job, results[piece.index])) + o
                         for o in piece.text_offsets],
                    )  # fmt: skip
                    so_far = (
                        responses.usage(job, [r.result for r in runs])
                        if job.body.continuous_usage
                        else None
                    )
                    body = responses.chunk(job, piece.index, piece.text, piece.finish_reason,
                                           piece.token_ids, lp, so_far, piece.tool_calls)  # fmt: skip
                    await resp.write(sse.encode_event(body))
                async with asyncio.timeout_at(deadline):
                    piece = await anext(pieces, None)
        except TimeoutError:
            status = "timeout"
            message = f"request timed out after {self._config.request_timeout_s} s"
            for run in runs:
                progress.failed(run.timeline, message)
            await resp.write(sse.encode_event(error_body(message, "timeout", code="timeout")))
        except PdserveError as exc:
            # Headers are out: the failure becomes the stream's last event, never a status.
            status = "no_capacity" if isinstance(exc, NoCapacity) else "error"
            await resp.write(sse.encode_event(error_body(str(exc), "server_error")))
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("request %s failed after its headers", job.request_id)
            status = "error"
            body = error_body("internal router error (see the router log)", "server_error")
            await resp.write(sse.encode_event(body))
        else:
            if job.body.include_usage:
                chosen = fanout.returned(job, runs)
                await resp.write(sse.encode_event(responses.usage_chunk(job, chosen)))
        await resp.write(sse.DONE)
        with contextlib.suppress(ConnectionResetError):  # the client left after [DONE]
            await resp.write_eof()
        return resp, status

    def _opening(self, job: Job, choice: responses.ChoiceResult) -> list[BaseModel]:
        """What a streamed choice starts with: the role (chat), the echoed prompt (echo)."""
        if job.kind == "chat":
            return [responses.chat_chunk(job, choice.index, ChatDelta(role="assistant"))]
        if not job.echo:
            return []
        offsets = responses.prompt_offsets(self._texts, choice.prompt)
        lp = responses.echo_logprobs(job, self._texts, choice, offsets)
        return [responses.chunk(job, choice.index, choice.prompt.text, None, None, lp)]

    @staticmethod
    def _echo_prefix(job: Job, choice: responses.ChoiceResult) -> str:
        return choice.prompt.text if job.echo else ""


def _json(body: BaseModel, status: int = 200) -> web.Response:
    return web.Response(text=body.model_dump_json(), status=status, content_type="application/json")
