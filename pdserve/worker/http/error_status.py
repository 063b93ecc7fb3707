"""How the worker's failures reach an HTTP client: errors as `ErrorBody` with a status.

The mapping is one table (`_STATUS`), read in class order, so a subclass can have its own
status ahead of its base. Validation errors from pydantic name every bad field. A handler
raises; the middleware renders; no handler builds an error response by hand.

It knows aiohttp and the protocol's `ErrorBody`; not engines or transfers.
"""

from __future__ import annotations

import logging

import pydantic
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from pdserve.errors import (
    CheckpointRefused,
    ConfigError,
    DeadlineExceeded,
    Draining,
    DuplicateRequest,
    Forbidden,
    KVNotReady,
    KVValueMismatch,
    LeaseError,
    NoFreeBlocks,
    Overloaded,
    PdserveError,
    PromptTooLong,
    RequestNotFound,
    StaleInstance,
    TransportUnavailable,
    Unauthenticated,
    Unauthorized,
    WrongRole,
)
from pdserve.protocol.worker_api import ErrorBody

logger = logging.getLogger(__name__)


# Checked in order: the first class the error is an instance of decides the status.
_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (Unauthenticated, 401),
    (StaleInstance, 410),
    (Forbidden, 403),
    (NoFreeBlocks, 503),
    (Draining, 503),
    (Overloaded, 503),
    (DeadlineExceeded, 504),
    (RequestNotFound, 404),
    (PromptTooLong, 400),
    (ConfigError, 400),
    (WrongRole, 409),
    (DuplicateRequest, 409),
    (KVNotReady, 409),
    (CheckpointRefused, 409),
    (KVValueMismatch, 409),
    (TransportUnavailable, 409),
    (LeaseError, 409),
    (Unauthorized, 403),
    (PdserveError, 500),
)
RETRY_AFTER_S = 1


def validation_message(exc: pydantic.ValidationError) -> str:
    """One line naming every bad field: `sampling.temperature: Input should be ...`."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "body"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


def error_response(exc: BaseException, worker_id: str) -> web.Response:
    """The `ErrorBody` response for `exc`."""
    if isinstance(exc, pydantic.ValidationError):
        body = ErrorBody(
            error=f"bad request body: {validation_message(exc)}",
            type="ValidationError",
            worker_id=worker_id,
        )
        return web.json_response(text=body.model_dump_json(), status=400)
    status = next((code for cls, code in _STATUS if isinstance(exc, cls)), 500)
    retryable = bool(getattr(exc, "retryable", False))
    body = ErrorBody(
        error=str(exc) or type(exc).__name__,
        type=type(exc).__name__ if status != 500 or isinstance(exc, PdserveError) else "Internal",
        retryable=retryable,
        worker_id=worker_id,
    )
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return web.json_response(text=body.model_dump_json(), status=status, headers=headers)


def error_middleware(worker_id: str) -> Middleware:
    """aiohttp middleware that renders every escaping exception as an `ErrorBody`."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge as exc:
            # aiohttp's text names the limit and the body's size.
            body = ErrorBody(error=exc.text or "", type="BodyTooLarge", worker_id=worker_id)
            return web.json_response(text=body.model_dump_json(), status=413)
        except web.HTTPException:
            raise
        except (pydantic.ValidationError, PdserveError) as exc:
            return error_response(exc, worker_id)
        except Exception as exc:
            logger.exception("%s %s failed", request.method, request.path)
            return error_response(exc, worker_id)

    return middleware
