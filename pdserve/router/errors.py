"""The router's exceptions, all under `pdserve.errors.PdserveError`.

    PdserveError
    └── RouterError
        ├── IllegalRequestTransition    a request state change the table does not allow
        ├── InvalidRequest              a client request refused with 400 (names the param)
        ├── NoCapacity                  no worker can take the request now (HTTP 503, retryable)
        ├── WorkerUnreachable           connection refused, reset or timed out (retryable)
        └── WorkerCallError             a worker answered non-2xx; carries its ErrorBody

They live here, not in `pdserve/errors.py`, only because that file belongs to another part of
the tree for now; each keeps the same `retryable` contract the failure policy reads.
"""

from __future__ import annotations

from pdserve.errors import PdserveError
from pdserve.worker.protocol import ErrorBody


class RouterError(PdserveError):
    """An error raised by the router."""


class IllegalRequestTransition(RouterError):
    """A request's state machine was asked for a transition its table does not allow."""

    def __init__(self, request_id: str, current: str, target: str) -> None:
        super().__init__(f"request {request_id}: illegal transition {current} -> {target}")
        self.current = current
        self.target = target


class NoCapacity(RouterError):
    """No compatible worker can take the request now; the client should retry later."""

    retryable = True

    def __init__(self, detail: str, retry_after_s: int = 1) -> None:
        super().__init__(f"no capacity: {detail}")
        self.retry_after_s = retry_after_s


class WorkerUnreachable(RouterError):
    """The worker did not answer: connection refused or reset, or the call timed out."""

    retryable = True

    def __init__(self, url: str, detail: str) -> None:
        super().__init__(f"worker {url}: unreachable: {detail}")
        self.url = url


class WorkerCallError(RouterError):
    """A worker answered a call with a non-2xx status and an `ErrorBody`."""

    def __init__(self, url: str, status: int, body: ErrorBody) -> None:
        super().__init__(f"worker {url}: HTTP {status}: {body.type}: {body.error}")
        self.url = url
        self.status = status
        self.body = body
        # 503 (no capacity) is worth trying elsewhere whatever the body says.
        self.retryable = body.retryable or status == 503


class InvalidRequest(RouterError):
    """A client request the router refuses (HTTP 400): names the OpenAI `param` at fault."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
