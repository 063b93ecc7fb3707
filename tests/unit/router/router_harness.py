"""A router on an in-process test server in front of fake workers, for router tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from cluster_auth import SECRET
from fake_worker import FakeWorker

from pdserve.auth.keys import BearerKey, KeyKind
from pdserve.clock import Clock
from pdserve.router.app import create_app
from pdserve.router.config import Mode, RouterConfig
from pdserve.router.workers.model_check import router_model_fields


@asynccontextmanager
async def router(
    model: Path,
    workers: list[FakeWorker],
    mode: Mode = "disagg",
    api_key: str | None = None,
    clock: Clock | None = None,
    **config: Any,
) -> AsyncIterator[TestClient]:  # type: ignore[type-arg]
    """Start `workers` and a router over them; `config` overrides RouterConfig fields, `clock`
    the breaker's clock.

    The fake workers report the router's model fields in their fingerprint (unless a test
    set another) and check every call's cluster signature."""
    fields = router_model_fields(model)
    for w in workers:
        if w.fingerprint is None:
            w.fingerprint = dict(fields)
        await w.start()
    settings: dict[str, Any] = {
        "health_poll_interval_s": 60.0,
        "cluster_secret": SECRET,
        **config,
    }
    router_config = RouterConfig(
        workers=tuple(w.url for w in workers),
        model=model,
        mode=mode,
        api_key=None if api_key is None else BearerKey(api_key, KeyKind.API, "test"),
        **settings,
    )
    client = TestClient(TestServer(await create_app(router_config, clock)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()
        for w in workers:
            await w.close()


def run(coro: Callable[[], Awaitable[None]]) -> None:
    """Run one test coroutine, bounded so a hang fails instead of stalling the suite."""

    async def bounded() -> None:
        async with asyncio.timeout(30):
            await coro()

    asyncio.run(bounded())


def completion(max_tokens: int = 4, **kw: object) -> dict[str, object]:
    """A greedy /v1/completions body."""
    return {"model": "tiny-v2", "prompt": "hello", "max_tokens": max_tokens, "temperature": 0, **kw}
