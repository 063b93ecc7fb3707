"""POST /v1/responses and GET /v1/responses/{id}."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from pdserve.errors import InvalidRequest
from pdserve.router.api.fanout import ChoiceRun
from pdserve.router.api.json_body import read_object, validate
from pdserve.router.api.render import RenderFactory
from pdserve.router.api.request_builder import RequestBuilder
from pdserve.router.api.responses import Job, error_body
from pdserve.router.api.responses_api.models import ResponsesRequest
from pdserve.router.api.responses_api.render import JsonBody, ResponsesRender
from pdserve.router.api.responses_api.store import ResponseStore, StoredResponse
from pdserve.router.api.responses_api.translate import chat_body, responses_error

Serve = Callable[[web.Request, Job, RenderFactory], Awaitable[web.StreamResponse]]


class ResponsesApi:
    """The Responses routes over the chat machinery (`serve` runs a job and writes it)."""

    def __init__(self, builder: RequestBuilder, serve: Serve, store: ResponseStore | None) -> None:
        self._builder = builder
        self._serve = serve
        self._store = store

    def add_routes(self, app: web.Application) -> None:
        """Register the routes on `app`."""
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)

    async def create(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/responses."""
        req = validate(ResponsesRequest, await read_object(request))
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            history = self._stored(req.previous_response_id, "previous_response_id").messages
        body, conversation = chat_body(req, history)
        response_id = f"resp_{uuid.uuid4().hex}"
        try:
            job = self._builder.chat(body, request_id=response_id)
        except InvalidRequest as exc:
            raise responses_error(exc) from exc
        store = self._store if req.store is not False else None

        def keep(response: dict[str, Any]) -> None:
            assert store is not None
            store.put(response_id, StoredResponse(response, conversation + _said(response)))

        def render(job: Job, runs: list[ChoiceRun]) -> ResponsesRender:
            return ResponsesRender(job, req, store is not None, keep if store is not None else None)

        return await self._serve(request, job, render)

    async def retrieve(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{id}: a stored response; 404 for any other id."""
        try:
            stored = self._stored(request.match_info["response_id"], "response_id")
        except InvalidRequest as exc:
            body = error_body(exc.message, "invalid_request_error", exc.param, "not_found")
            return web.json_response(text=body.model_dump_json(), status=404)
        return web.json_response(text=JsonBody(stored.response).model_dump_json())

    def _stored(self, response_id: str, param: str) -> StoredResponse:
        if self._store is None:
            raise InvalidRequest(
                f"{param}: this router stores no responses (start it with --enable-store)", param
            )
        stored = self._store.get(response_id)
        if stored is None:
            raise InvalidRequest(
                f"{param}: no stored response {response_id!r} (never stored by this router,"
                " or evicted)",
                param,
                "not_found",
            )
        return stored


def _said(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The response's output as the assistant message a continued conversation holds."""
    text = "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )
    calls = [
        {"id": item["call_id"], "type": "function",
         "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in response["output"]
        if item["type"] == "function_call"
    ]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]
