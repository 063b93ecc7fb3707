"""The benchmarks' SSE reader: the events in order up to [DONE], comments and blank lines
skipped; a non-200 answer or an error event raises naming the session."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pdlab.bench.stream_events import stream_events


def _events(body: bytes, status: int = 200) -> list[dict[str, Any]]:
    """What stream_events yields for a server answering `body` with `status`."""

    async def answer(request: web.Request) -> web.Response:
        assert await request.json() == {"stream": True}
        return web.Response(body=body, status=status, content_type="text/event-stream")

    async def run() -> list[dict[str, Any]]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", answer)
        async with TestServer(app) as server, aiohttp.ClientSession() as http:
            url = str(server.make_url("/v1/chat/completions"))
            return [e async for e in stream_events(http, url, {"stream": True}, "agent-3")]

    return asyncio.run(asyncio.wait_for(run(), 30))


def test_events_come_in_order_up_to_done() -> None:
    body = b': ping\n\ndata: {"n": 1}\n\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
    assert _events(body) == [{"n": 1}, {"n": 2}]


def test_an_error_event_raises_naming_the_session() -> None:
    body = b'data: {"n": 1}\n\ndata: {"error": {"message": "worker lost"}}\n\n'
    with pytest.raises(RuntimeError, match=r"agent-3: \{'message': 'worker lost'\}"):
        _events(body)


def test_a_refused_request_raises_with_its_status_and_body() -> None:
    with pytest.raises(RuntimeError, match="agent-3: HTTP 400: bad tools"):
        _events(b"bad tools", status=400)
