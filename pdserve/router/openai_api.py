"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

A request goes: JSON → pydantic model → checks (model name, n, prompt length against the
model's max_position_embeddings, sampling ranges), each failure an `InvalidRequest` naming the
OpenAI `param` → token ids (chat via the tokenizer's template) → a flow chosen by the
dispatcher → `OutputStream` (detokenization, stop strings, max_tokens) → one JSON body, or SSE
chunks ending in `data: [DONE]`.

A streamed response's headers are sent only after the first token arrives, so "no capacity"
and worker-side refusals are still proper HTTP statuses; anything that fails after that (a
worker fault, the request's deadline) is sent as a final `data: {"error": ...}` event followed
by `data: [DONE]` and a clean end of stream, never a status line written into the body. A
client that disconnects (streaming or not) cancels its handler, and closing the flow releases
what the workers hold. Every request has one deadline (`--request-timeout-s`) that bounds it
end to end and that every worker call is told about.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from pdserve.engine.sampling_params import SamplingParams
from pdserve.errors import (
    InvalidRequest,
    ModelConfigError,
    NoCapacity,
    PdserveError,
    RouterError,
    SamplingParamsError,
    WorkerCallError,
)
from pdserve.model.tokenizer import Tokenizer
from pdserve.observability.phases import handoff_phases
from pdserve.observability.spikes import SpikeDetector
from pdserve.router import responses, sse
from pdserve.router.config import RouterConfig
from pdserve.router.dispatcher import Dispatcher
from pdserve.router.flow import Flow, FlowRequest
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai_models import (
    ChatCompletionRequest,
    ChatDelta,
    CompletionRequest,
    ModelCard,
    ModelList,
    SamplingFields,
)
from pdserve.router.output import OutputStream
from pdserve.router.responses import Job, error_body
from pdserve.router.state import RequestState
from pdserve.worker.protocol import SamplingModel

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Piece:
    """Text released by one worker chunk; `finish_reason` set on the last."""

    text: str
    finish_reason: str | None
    # The tokens the output accepted from this chunk (for `return_token_ids`).
    token_ids: list[int]


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
        self._model_names = {config.model_name, str(config.model)}
        self._created = int(time.time())
        # Baselines of handoff phases; a finished request far over one is logged and counted.
        self.spikes = SpikeDetector()

    def add_routes(self, app: web.Application) -> None:
        """Register the /v1 routes on `app`."""
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)

    async def models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the one served model."""
        card = ModelCard(
            id=self._config.model_name, created=self._created, max_model_len=self._max_model_len
        )
        return _json(ModelList(data=[card]))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        body = await _parse(request, CompletionRequest)
        if isinstance(body.prompt, str):
            if not body.prompt:
                raise InvalidRequest("prompt: must not be empty", "prompt")
            ids = self._tokenizer.encode(body.prompt)
        else:
            bad = [t for t in body.prompt if not 0 <= t < self._tokenizer.vocab_size]
            if not body.prompt or bad:
                raise InvalidRequest(
                    f"prompt: token ids must be a non-empty list in [0, "
                    f"{self._tokenizer.vocab_size}), got {bad[:5] or 'an empty list'}",
                    "prompt",
                )
            ids = list(body.prompt)
        job = self._job("completion", "cmpl", body, ids, "prompt", _or(body.max_tokens, 16))
        return await self._serve(request, job)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions (prompt from the tokenizer's chat template)."""
        body = await _parse(request, ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        try:
            ids = self._tokenizer.encode_chat(messages)
        except ModelConfigError as exc:
            raise InvalidRequest(f"messages: {exc}", "messages") from exc
        # OpenAI's default for chat is "until the context is full".
        default = max(self._max_model_len - len(ids), 1)
        max_tokens = _or(body.max_completion_tokens, _or(body.max_tokens, default))
        job = self._job("chat", "chatcmpl", body, ids, "messages", max_tokens)
        return await self._serve(request, job)

    def _job(
        self,
        kind: str,
        prefix: str,
        body: SamplingFields,
        ids: list[int],
        prompt_param: str,
        max_tokens: int,
    ) -> Job:
        if body.model not in self._model_names:
            raise InvalidRequest(
                f"model: {body.model!r} is not served here (serving {self._config.model_name!r})",
                "model",
                "model_not_found",
            )
        if body.n != 1:
            raise InvalidRequest(f"n: only n=1 is supported, got {body.n}", "n")
        limit = self._max_model_len
        if len(ids) >= limit:
            raise InvalidRequest(
                f"{prompt_param}: the prompt has {len(ids)} tokens; this model's context is "
                f"{limit} tokens (max_position_embeddings)",
                prompt_param,
                "context_length_exceeded",
            )
        if max_tokens >= 1 and len(ids) + max_tokens > limit:
            raise InvalidRequest(
                f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"this model's context of {limit} tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_k=body.top_k,
                top_p=body.top_p,
                # Drawn here when absent, so the prefill, decode and any migration target all
                # sample with one seed: a replay then continues the same random stream.
                seed=body.seed if body.seed is not None else secrets.randbits(63),
                stop=tuple(body.stop_list()),
                ignore_eos=body.ignore_eos,
            )
        except SamplingParamsError as exc:
            field = str(exc).split(":", 1)[0]
            raise InvalidRequest(str(exc), field) from exc
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        sampling = SamplingModel.from_params(params)
        return Job(kind, request_id, int(time.time()), body, ids, sampling)

    async def _serve(self, request: web.Request, job: Job) -> web.StreamResponse:
        flow, timeline = self._dispatcher.begin(job.request_id)
        mode = timeline.mode
        output = OutputStream(self._tokenizer, job.sampling, self._tokenizer.eos_token_ids)
        session_id = request.headers.get("x-session-id") or job.body.user
        deadline = asyncio.get_running_loop().time() + self._config.request_timeout_s
        freq = FlowRequest(
            job.request_id, job.prompt_token_ids, job.sampling, timeline, session_id, deadline
        )
        status = "error"
        try:
            async with contextlib.aclosing(self._pieces(flow, freq, output)) as pieces:
                if job.body.stream:
                    resp, status = await self._stream(request, job, pieces, output, deadline)
                else:
                    async with asyncio.timeout_at(deadline):
                        text = "".join([p.text async for p in pieces])
                    resp = _json(responses.whole(job, text, output))
                    status = "ok"
            return resp
        except NoCapacity:
            status = "no_capacity"
            raise
        except WorkerCallError as exc:
            status = "client_error" if exc.status == 400 else "error"
            raise
        except TimeoutError:
            timeline.fail(f"request timeout ({self._config.request_timeout_s} s)")
            status = "timeout"
            raise
        except (ConnectionResetError, asyncio.CancelledError):
            status = "cancelled"  # the client went away: the flow was closed, holds released
            timeline.fail("client disconnected")
            raise
        finally:
            self._metrics.count_request(mode, status)
            if status == "ok" and mode == "disagg":
                for spike in self.spikes.observe(job.request_id, handoff_phases(timeline.history)):
                    log.warning("%s", spike.describe())

    async def _pieces(
        self, flow: Flow, freq: FlowRequest, output: OutputStream
    ) -> AsyncGenerator[_Piece, None]:
        timeline = freq.timeline
        async with contextlib.aclosing(flow.stream(freq)) as chunks:
            async for chunk in chunks:
                before = output.num_tokens
                text = output.add_all(chunk.token_ids)
                accepted = output.token_ids[before:]
                if chunk.finish_reason is not None and not output.finished:
                    text += output.finish(chunk.finish_reason)
                if output.finished and not timeline.done:
                    # Finished here (stop string, max_tokens) before the worker said so; closing
                    # the flow after this releases the worker's copy without a failure record.
                    timeline.advance(RequestState.FINISHED, f"router: {output.finish_reason}")
                yield _Piece(text, output.finish_reason, accepted)
                if output.finished:
                    return
        raise RouterError(f"request {freq.request_id}: the flow ended without finishing")

    async def _stream(
        self,
        request: web.Request,
        job: Job,
        pieces: AsyncGenerator[_Piece, None],
        output: OutputStream,
        deadline: float,
    ) -> tuple[web.StreamResponse, str]:
        """The SSE response and the request's status for the metrics."""
        # Wait for the first token before committing to a 200, so early errors keep a status.
        async with asyncio.timeout_at(deadline):
            first = await anext(pieces)
        resp = web.StreamResponse(headers={"Content-Type": sse.CONTENT_TYPE})
        await resp.prepare(request)
        if job.kind == "chat":
            role = responses.chat_chunk(job, ChatDelta(role="assistant"))
            await resp.write(sse.encode_event(role))
        piece: _Piece | None = first
        status = "ok"
        try:
            while piece is not None:
                if (
                    piece.text
                    or piece.finish_reason is not None
                    or (job.body.return_token_ids and piece.token_ids)
                ):
                    body = responses.chunk(job, piece.text, piece.finish_reason, piece.token_ids)
                    await resp.write(sse.encode_event(body))
                if piece.finish_reason is not None:
                    break
                async with asyncio.timeout_at(deadline):
                    piece = await anext(pieces, None)
        except TimeoutError:
            status = "timeout"
            message = f"request timed out after {self._config.request_timeout_s} s"
            job_timeline = self._dispatcher.timeline(job.request_id)
            if job_timeline is not None:
                job_timeline.fail(message)
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
                await resp.write(sse.encode_event(responses.usage_chunk(job, output)))
        await resp.write(sse.DONE)
        await resp.write_eof()
        return resp, status


_M = TypeVar("_M", bound=BaseModel)


async def _parse(request: web.Request, model: type[_M]) -> _M:
    # pydantic's own JSON parser, not json.loads: it bounds nesting depth (json.loads raises
    # RecursionError) and refuses invalid UTF-8 and lone surrogate escapes ("\ud800"), which
    # json.loads turns into str values that no tokenizer or JSON encoder downstream accepts.
    raw = await request.read()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] == "json_invalid":
            raise InvalidRequest(
                f"malformed JSON body: {err['msg']}", None, "invalid_json"
            ) from exc
        if not err["loc"]:
            raise InvalidRequest("the body must be a JSON object", None, "invalid_json") from exc
        # loc[0] is the top-level field; deeper parts name union members or list indices.
        where = ".".join(str(p) for p in err["loc"])
        raise InvalidRequest(f"{where}: {err['msg']}", str(err["loc"][0])) from exc


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _json(body: BaseModel, status: int = 200) -> web.Response:
    return web.Response(text=body.model_dump_json(), status=status, content_type="application/json")
