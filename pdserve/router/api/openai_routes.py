"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models, and vLLM's
/v1/chat/completions/batch (`chat_batch`: one chat flow per conversation).

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
from collections.abc import AsyncGenerator, Sequence

from aiohttp import web
from pydantic import BaseModel

from pdserve.errors import NoCapacity, PdserveError, WorkerCallError
from pdserve.model.tokenizer import Tokenizer
from pdserve.observability.phases import handoff_phases
from pdserve.observability.spikes import SpikeDetector
from pdserve.router.api import chat_batch, fanout, sse
from pdserve.router.api.chat_render import ChatRender
from pdserve.router.api.fanout import ChoiceRun, Piece
from pdserve.router.api.json_body import read_object
from pdserve.router.api.logprobs_format import TokenTexts
from pdserve.router.api.openai_models import ModelCard, ModelList
from pdserve.router.api.render import Render, RenderFactory
from pdserve.router.api.request_builder import BuilderConfig, RequestBuilder
from pdserve.router.api.responses import Job
from pdserve.router.api.responses_api.routes import ResponsesApi
from pdserve.router.api.responses_api.store import ResponseStore
from pdserve.router.api.sampling_defaults import SamplingDefaults, read_sampling_defaults
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
                return_tokens_as_token_ids=config.return_tokens_as_token_ids,
                tool_format=FORMATS[config.tool_call_parser],
                defaults=read_sampling_defaults(config.model)
                if config.generation_config == "auto"
                else SamplingDefaults(),
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
        app.router.add_post("/v1/chat/completions/batch", self.chat_completions_batch)
        app.router.add_get("/v1/models", self.models)
        store = (
            ResponseStore(self._config.responses_store_size) if self._config.enable_store else None
        )
        ResponsesApi(self._builder, self.serve, store).add_routes(app)

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
        return await self.serve(request, job)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions (prompt from the chat template)."""
        job = self._builder.chat(await read_object(request))
        return await self.serve(request, job)

    async def chat_completions_batch(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions/batch (vLLM's): one chat flow per conversation."""
        batch = chat_batch.build(self._builder, await read_object(request))
        return await self.serve(request, batch.job, batch.render(self._texts), batch.parts)

    async def serve(
        self,
        request: web.Request,
        job: Job,
        render_for: RenderFactory | None = None,
        parts: Sequence[Job] = (),
    ) -> web.StreamResponse:
        """Run `job`'s flows (or those of `parts`, the jobs that answer it together: a batch's
        conversations) and write its answer with the render `render_for` makes (the chat and
        completions one by default)."""
        session_id = request.headers.get("x-session-id") or job.body.user
        deadline = asyncio.get_running_loop().time() + self._config.request_timeout_s
        runs = [
            run
            for part in parts or (job,)
            for run in fanout.start(part, self._dispatcher, self._tokenizer, session_id, deadline)
        ]
        render = (render_for or self._chat_render)(job, runs)
        mode = runs[0].timeline.mode
        status = "error"
        try:
            async with contextlib.aclosing(fanout.pieces(runs)) as pieces:
                if job.body.stream:
                    resp, status = await self._stream(request, job, pieces, runs, render, deadline)
                else:
                    async with asyncio.timeout_at(deadline):
                        async for piece in pieces:
                            render.observe(piece)
                    resp = _json(render.whole(fanout.returned(job, runs)))
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

    def _chat_render(self, job: Job, runs: list[ChoiceRun]) -> ChatRender:
        return ChatRender(job, self._texts, runs)

    async def _stream(
        self,
        request: web.Request,
        job: Job,
        pieces: AsyncGenerator[Piece, None],
        runs: list[ChoiceRun],
        render: Render,
        deadline: float,
    ) -> tuple[web.StreamResponse, str]:
        """The SSE response and the request's status for the metrics."""
        # Wait for the first token before committing to a 200, so early errors keep a status.
        async with asyncio.timeout_at(deadline):
            first = await anext(pieces)
        resp = web.StreamResponse(headers={"Content-Type": sse.CONTENT_TYPE})
        await resp.prepare(request)
        piece: Piece | None = first
        status = "ok"
        try:
            while piece is not None:
                for event in render.events(piece):
                    await resp.write(event)
                async with asyncio.timeout_at(deadline):
                    piece = await anext(pieces, None)
        except TimeoutError:
            status = "timeout"
            message = f"request timed out after {self._config.request_timeout_s} s"
            for run in runs:
                progress.failed(run.timeline, message)
            for event in render.failed(message, "timeout", "timeout"):
                await resp.write(event)
        except PdserveError as exc:
            # Headers are out: the failure becomes the stream's last event, never a status.
            status = "no_capacity" if isinstance(exc, NoCapacity) else "error"
            for event in render.failed(exc.client_message(), "server_error"):
                await resp.write(event)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("request %s failed after its headers", job.request_id)
            status = "error"
            for event in render.failed(
                "internal router error (see the router log)", "server_error"
            ):
                await resp.write(event)
        for event in render.closing(fanout.returned(job, runs), status == "ok"):
            await resp.write(event)
        with contextlib.suppress(ConnectionResetError):  # the client left after the last event
            await resp.write_eof()
        return resp, status


def _json(body: BaseModel, status: int = 200) -> web.Response:
    return web.Response(text=body.model_dump_json(), status=status, content_type="application/json")
