"""A client's JSON body as a dict, and as a validated model: each failure a 400 naming it."""

from __future__ import annotations

from typing import Any, TypeVar

import pydantic_core
from aiohttp import web
from pydantic import BaseModel, ValidationError

from pdserve.errors import InvalidRequest
from pdserve.router.api.responses import error_body

M = TypeVar("M", bound=BaseModel)


async def read_object(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object; InvalidRequest (code invalid_json) otherwise. A body sent as
    another media type (a form, text) is a 415, as vLLM answers it; no Content-Type at all is
    read as JSON."""
    if "Content-Type" in request.headers and request.content_type != "application/json":
        body = error_body(
            f"unsupported media type {request.content_type!r}: send application/json",
            code="unsupported_media_type",
        )
        raise web.HTTPUnsupportedMediaType(
            text=body.model_dump_json(), content_type="application/json"
        )
    raw = await request.read()
    # pydantic's JSON parser, not json.loads: it bounds nesting depth (json.loads raises
    # RecursionError), refuses invalid UTF-8, lone surrogate escapes ("\ud800": str values no
    # tokenizer or JSON encoder downstream accepts) and the non-JSON NaN / Infinity literals.
    try:
        data = pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        raise InvalidRequest(f"malformed JSON body: {exc}", None, "invalid_json") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object", None, "invalid_json")
    return data


def validate(model: type[M], data: dict[str, Any]) -> M:
    """`data` as `model`; InvalidRequest whose `param` is the top-level field at fault."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        # loc[0] is the top-level field; deeper parts name union members or list indices.
        param = str(err["loc"][0]) if err["loc"] else None
        where = ".".join(str(p) for p in err["loc"])
        raise InvalidRequest(f"{where}: {err['msg']}", param) from exc
