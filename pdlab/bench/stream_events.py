"""A streamed OpenAI answer read as its events, for the benchmarks that time turns (agents,
multiturn): any failure raises, since a benchmark turn that failed has no figure to give."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp


async def stream_events(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], who: str
) -> AsyncIterator[dict[str, Any]]:
    """POST `body` to `url` and yield each SSE event's JSON, up to `data: [DONE]`.

    A status other than 200 or an error event raises RuntimeError naming `who` (the session)."""
    async with http.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{who}: HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event: dict[str, Any] = json.loads(line.removeprefix("data: "))
            if "error" in event:
                raise RuntimeError(f"{who}: {event['error']}")
            yield event
