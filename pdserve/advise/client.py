"""An OpenAI-API client for benchmarks and chaos runs: token ids, text, errors, timing.

`send` posts one request body (completions or chat, streamed or not; possibly malformed on
purpose) and returns a `Completion` however it ended, never raising for a failure: the typed
error of an error status or a stream's error event, a connection that broke, a deadline. Each
well-formed request asks for `return_token_ids`, so the client counts exactly the tokens it
was sent (text alone cannot tell a repeated token from a repeated word). With
`disconnect_after` the client leaves once it has that many tokens, as a user closing a tab.
`responded` says whether the server had begun its answer: before that, a connection failure
can be retried elsewhere (what a load balancer does); after it, it cannot.
`stream_completion` is the streamed /v1/completions call of `pdserve chaos`.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

# Called after every streamed chunk with the number of tokens received so far.
OnTokens = Callable[[int], Awaitable[None]]


class Ending(enum.StrEnum):
    """How a request ended, as the client saw it."""

    # The response (or the stream's last chunk) carried a finish reason.
    COMPLETE = "complete"
    # The client left on purpose after `disconnect_after` tokens.
    CLIENT_DISCONNECT = "client_disconnect"
    # An error status with an OpenAI error body (before any token).
    HTTP_ERROR = "http_error"
    # A `data: {"error": ...}` event after the stream began.
    STREAM_ERROR = "stream_error"
    # The connection broke after the response began, with no finish reason and no error.
    CUT = "cut"
    # The connection failed before any response (refused, or reset before the headers).
    UNREACHABLE = "unreachable"
    # The client's own deadline expired.
    TIMEOUT = "timeout"


@dataclass(slots=True)
class Completion:
    """One request as the client saw it."""

    # The router's response id (`cmpl-…`): the key of GET /debug/requests/{id}.
    request_id: str | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # "type (status): message" of the router's error, or of the connection failure.
    error: str | None = None
    # Seconds from sending the request to the first token, and to the end of the stream.
    ttft_s: float | None = None
    latency_s: float = 0.0
    status: int | None = None
    text: str = ""
    ending: Ending = Ending.COMPLETE
    error_type: str | None = None
    error_param: str | None = None
    # Whether the server began its answer (headers received).
    responded: bool = False


async def send(
    session: aiohttp.ClientSession,
    base_url: str,
    path: str,
    body: bytes,
    *,
    stream: bool,
    timeout_s: float = 120.0,
    disconnect_after: int | None = None,
    on_tokens: OnTokens | None = None,
) -> Completion:
    """POST `body` to `base_url + path` and collect the answer; never raises for a failure."""
    out = Completion()
    start = time.perf_counter()
    try:
        async with session.post(
            base_url + path,
            data=body,
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            out.responded = True
            out.status = resp.status
            if resp.status != 200:
                _error(out, resp.status, await resp.text(), Ending.HTTP_ERROR)
            elif stream:
                await _read_stream(resp, out, start, disconnect_after, on_tokens)
            else:
                _read_whole(await resp.json(content_type=None), out, start)
    except TimeoutError:
        out.ending = Ending.TIMEOUT
        out.error = f"timeout: no end within {timeout_s} s"
    except (aiohttp.ClientError, ConnectionError, ValueError) as exc:
        # Broken after the finish reason arrived: every token is here, nothing was lost.
        if out.finish_reason is None or out.ending is not Ending.COMPLETE:
            out.ending = Ending.CUT if out.responded else Ending.UNREACHABLE
            out.error = f"connection_error: {type(exc).__name__}: {exc}"
    finally:
        out.latency_s = time.perf_counter() - start
    return out


async def _read_stream(
    resp: aiohttp.ClientResponse,
    out: Completion,
    start: float,
    disconnect_after: int | None,
    on_tokens: OnTokens | None,
) -> None:
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: ") :])
        if "error" in chunk:
            _error(out, 200, json.dumps(chunk), Ending.STREAM_ERROR)
            return
        out.request_id = out.request_id or chunk.get("id")
        if not chunk.get("choices"):
            continue  # the usage chunk
        choice = chunk["choices"][0]
        new = choice.get("token_ids") or []
        if new and out.ttft_s is None:
            out.ttft_s = time.perf_counter() - start
        out.token_ids.extend(new)
        delta = choice.get("delta")
        out.text += (delta.get("content") or "") if delta is not None else choice.get("text", "")
        out.finish_reason = choice.get("finish_reason") or out.finish_reason
        if on_tokens is not None and new:
            await on_tokens(len(out.token_ids))
        if (
            out.finish_reason is None
            and disconnect_after is not None
            and len(out.token_ids) >= disconnect_after
        ):
            out.ending = Ending.CLIENT_DISCONNECT
            resp.close()  # leave now, as a user closing the tab
            return
    # Read to the end ([DONE]), so the server sees a client that stayed.
    if out.finish_reason is None:
        out.ending = Ending.CUT
        out.error = "stream_error: the stream ended without a finish reason"


def _read_whole(body: dict[str, object], out: Completion, start: float) -> None:
    out.request_id = str(body.get("id"))
    choice = body["choices"][0]  # type: ignore[index]
    message = choice.get("message")
    out.text = (message.get("content") or "") if message is not None else choice.get("text", "")
    out.token_ids = list(choice.get("token_ids") or [])
    out.finish_reason = choice.get("finish_reason")
    out.ttft_s = time.perf_counter() - start
    out.ending = Ending.COMPLETE if out.finish_reason is not None else Ending.CUT


def _error(out: Completion, status: int, text: str, ending: Ending) -> None:
    """Record an OpenAI-style error body ("type (status): message")."""
    out.ending = ending
    try:
        error = json.loads(text)["error"]
        out.error_type = error.get("type")
        out.error_param = error.get("param")
        out.error = f"{error.get('type', 'error')} ({status}): {error.get('message', '')}"
    except (ValueError, KeyError, TypeError, AttributeError):
        out.error = f"http_{status}: {text[:200]}"


async def stream_completion(
    session: aiohttp.ClientSession,
    router_url: str,
    body: dict[str, object],
    on_tokens: OnTokens | None = None,
    timeout_s: float = 120.0,
) -> Completion:
    """POST a streamed /v1/completions with `body` and collect it; never raises for a failure."""
    payload = json.dumps({**body, "stream": True, "return_token_ids": True}).encode()
    return await send(
        session,
        router_url,
        "/v1/completions",
        payload,
        stream=True,
        timeout_s=timeout_s,
        on_tokens=on_tokens,
    )
