"""A worker's control calls to other workers (checkpoint holders), signed like the router's.

Only checkpoints make a worker call another worker's control API (besides the best-effort
give-up notice): a decode worker puts, renews and releases at its holder, a resuming worker
looks up and pulls. Every call carries the cluster credential (`auth_headers`), is bounded by
a timeout, and fails with one typed error, `PeerCallError`, naming the peer, the status and
the peer's error class.

It knows aiohttp and the protocol models; not what the calls mean.
"""

from __future__ import annotations

import ssl
from typing import TypeVar

import aiohttp
from pydantic import BaseModel, ValidationError

from pdserve.auth.signing import auth_headers
from pdserve.auth.tls import http_connector
from pdserve.errors import PeerCallError
from pdserve.protocol.worker_api import ErrorBody

M = TypeVar("M", bound=BaseModel)


class PeerClient:
    """Signed JSON POSTs to other workers."""

    def __init__(
        self, key: bytes | None, tls: ssl.SSLContext | None = None, timeout_s: float = 5.0
    ) -> None:
        self._key = key
        self._tls = tls
        self._timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=http_connector(self._tls))
        return self._session

    async def post(
        self, url: str, path: str, body: BaseModel, model: type[M], timeout_s: float | None = None
    ) -> M:
        """POST `body` to `url + path`; the reply as `model`, or PeerCallError."""
        data = body.model_dump_json().encode()
        headers = {"Content-Type": "application/json"}
        headers.update(auth_headers(self._key, "POST", path, data))
        timeout = aiohttp.ClientTimeout(total=timeout_s or self._timeout_s)
        try:
            async with self._open().post(
                f"{url}{path}", data=data, headers=headers, timeout=timeout
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    try:
                        error = ErrorBody.model_validate_json(raw)
                    except ValidationError:
                        raise PeerCallError(
                            url, resp.status, "", raw[:200].decode(errors="replace")
                        ) from None
                    raise PeerCallError(url, resp.status, error.type, error.error)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise PeerCallError(url, 0, "", f"{path}: {type(exc).__name__}: {exc}") from None
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            raise PeerCallError(url, 200, "", f"{path}: bad reply: {exc}") from None

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
