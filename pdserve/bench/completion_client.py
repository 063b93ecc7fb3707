"""A streaming /v1/completions client for benchmarks and chaos runs: token ids, errors, timing.

Each request asks for `return_token_ids`, so the client counts exactly the tokens it was sent
(text alone cannot tell a repeated token from a repeated word). A failure is never raised: it
comes back as the `error` of the `Completion`, typed as the router (or the connection) gave it,
so one run reports every request however it ended.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

# Called after every streamed chunk with the number of tokens received so far.
OnTokens = Callable[[int], Awaitable[None]]


@dataclass(slots=True)
class Completion:
    """One streamed completion as the client saw it."""

    # The router's response id (`cmpl-…`): the key of GET /debug/requests/{id}.
    request_id: str | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # "type: message" of the router's error body, or of the connection failure.
    error: str | None = None
    # Seconds from sending the request to the first token, and to the end of the stream.
    ttft_s: float | None = None
    latency_s: float = 0.0
    # The text of the streamed chunks, concatenated.
    text: str = ""


async def stream_completion(
    session: aiohttp.ClientSession,
    router_url: str,
    body: dict[str, object],
    on_tokens: OnTokens | None = None,
    timeout_s: float = 120.0,
) -> Completion:
    """POST a streamed completion with `body` and collect it; never raises for a failure."""
    out = Completion()
    start = time.perf_counter()
    payload = {**body, "stream": True, "return_token_ids": True}
    try:
        async with session.post(
            f"{router_url}/v1/completions",
            json=payload,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            if resp.status != 200:
                out.error = _error_text(resp.status, await resp.text())
                return out
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    out.error = _error_text(200, json.dumps(chunk))
                    return out
                out.request_id = out.request_id or chunk.get("id")
                choice = chunk["choices"][0]
                new = choice.get("token_ids") or []
                if new and out.ttft_s is None:
                    out.ttft_s = time.perf_counter() - start
                out.token_ids.extend(new)
                out.text += choice.get("text") or ""
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
                if on_tokens is not None and new:
                    await on_tokens(len(out.token_ids))
            if out.finish_reason is None:
                out.error = "stream_error: the stream ended without a finish reason"
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
        out.error = f"connection_error: {type(exc).__name__}: {exc}"
    finally:
        out.latency_s = time.perf_counter() - start
    return out


def _error_text(status: int, text: str) -> str:
    """ "type: message" from an OpenAI-style error body, or the raw text."""
    try:
        error = json.loads(text)["error"]
        return f"{error.get('type', 'error')} ({status}): {error.get('message', '')}"
    except (ValueError, KeyError, TypeError):
        return f"http_{status}: {text[:200]}"
