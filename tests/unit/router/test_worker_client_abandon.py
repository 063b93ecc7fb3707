"""`WorkerClient.abandon`: a worker that left the pool has its open token streams and control
calls cut at once, so the flows fail over instead of waiting out a silent worker's timeouts."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from pdserve.errors import WorkerUnreachable
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker_api import (
    DecodeRequest,
    PrefillRequest,
    TokenEvent,
)
from pdserve.router.workers.client import ClientTimeouts, WorkerClient


async def _one_token_then_silence(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    await resp.prepare(request)
    await resp.write(TokenEvent(token_ids=[7]).model_dump_json().encode() + b"\n")
    await asyncio.Event().wait()  # a partitioned worker: the connection stays, nothing comes
    return resp


def _never_answers(
    arrived: asyncio.Queue[None],
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A handler that tells `arrived` of each request, then never answers it."""

    async def handle(request: web.Request) -> web.Response:
        arrived.put_nowait(None)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return handle


def test_abandon_cuts_a_silent_control_call_but_not_a_cancelled_caller() -> None:
    async def body() -> None:
        arrived: asyncio.Queue[None] = asyncio.Queue()
        app = web.Application()
        app.router.add_post("/prefill", _never_answers(arrived))
        server = TestServer(app)
        await server.start_server()
        url = str(server.make_url("")).rstrip("/")
        prefill = PrefillRequest(request_id="r", prompt_token_ids=[1, 2], sampling=SamplingParams())
        async with aiohttp.ClientSession() as session:
            client = WorkerClient(session, ClientTimeouts(prefill_s=60.0))
            call = asyncio.ensure_future(client.prefill(url, prefill))
            await asyncio.wait_for(arrived.get(), 5)  # open: the worker has it
            assert client.abandon(url) == 1
            try:
                await asyncio.wait_for(call, 5)
                raise AssertionError("a cut call answered")
            except WorkerUnreachable as exc:
                assert "left the pool" in str(exc)
            # The caller's own cancellation stays a cancellation, not a worker failure.
            call = asyncio.ensure_future(client.prefill(url, prefill))
            await asyncio.wait_for(arrived.get(), 5)
            call.cancel()
            try:
                await call
                raise AssertionError("a cancelled call answered")
            except asyncio.CancelledError:
                pass
            assert client.abandon(url) == 0  # nothing left open
        await server.close()

    asyncio.run(asyncio.wait_for(body(), 30))


def test_abandon_cuts_a_silent_stream_and_the_read_fails_over() -> None:
    async def body() -> None:
        app = web.Application()
        app.router.add_post("/decode", _one_token_then_silence)
        server = TestServer(app)
        await server.start_server()
        url = str(server.make_url("")).rstrip("/")
        async with aiohttp.ClientSession() as session:
            client = WorkerClient(session, ClientTimeouts(stream_read_s=60.0))
            stream = client.decode(url, DecodeRequest(request_id="r", first_token_id=1))
            first = await anext(stream)
            assert first.token_ids == [7]
            assert client.abandon("http://elsewhere") == 0
            loop = asyncio.get_running_loop()
            start = loop.time()
            pending = asyncio.ensure_future(anext(stream))
            # One turn of the loop: the read runs up to its wait for bytes that never come.
            await asyncio.sleep(0)
            assert not pending.done()
            assert client.abandon(url) == 1
            try:
                await asyncio.wait_for(pending, 5)
                raise AssertionError("a cut stream yielded another event")
            except (WorkerUnreachable, StopAsyncIteration):
                pass  # either ends the flow's read; both lead to failover
            assert loop.time() - start < 5  # not the 60 s read timeout
            assert client.abandon(url) == 0  # forgotten once cut
            await stream.aclose()
        await server.close()

    asyncio.run(asyncio.wait_for(body(), 30))


def test_a_cancelled_cleanup_still_releases_on_every_worker_it_names() -> None:
    """A leg's release goes to its decode and its prefill worker at once: the caller cancelled
    while the first worker is slow to answer (the client hung up) skips neither."""

    async def body() -> None:
        arrived: asyncio.Queue[str] = asyncio.Queue()
        answer = asyncio.Event()

        async def release(request: web.Request) -> web.Response:
            arrived.put_nowait(request.host)
            await answer.wait()
            return web.json_response({"request_id": "r", "num_freed_blocks": 0})

        servers = []
        for _ in range(2):
            app = web.Application()
            app.router.add_post("/release", release)
            servers.append(TestServer(app))
            await servers[-1].start_server()
        decode, prefill = (str(s.make_url("")).rstrip("/") for s in servers)
        async with aiohttp.ClientSession() as session:
            client = WorkerClient(session, ClientTimeouts(control_s=5.0))
            caller = asyncio.ensure_future(client.release_quietly(decode, "r", prefill))
            first = await asyncio.wait_for(arrived.get(), 5)
            caller.cancel()
            second = await asyncio.wait_for(arrived.get(), 5)  # not skipped by the cancel
            assert {first, second} == {decode.split("//")[1], prefill.split("//")[1]}
            answer.set()
            try:
                await caller
                raise AssertionError("the cancel was swallowed")
            except asyncio.CancelledError:
                pass
            # Both releases end, neither cut by the cancel.
            await asyncio.wait_for(asyncio.gather(*client._cleanups), 5)
        for server in servers:
            await server.close()

    asyncio.run(body())
