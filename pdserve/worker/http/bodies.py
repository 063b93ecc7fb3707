"""Request and response bodies of the worker's HTTP API: protocol models in, JSON out."""

from __future__ import annotations

from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: web.Request, model: type[M]) -> M:
    """The body as `model`; pydantic's ValidationError (-> 400 naming the field) otherwise."""
    return model.model_validate_json(await request.read())


def json_body(body: BaseModel, status: int = 200) -> web.Response:
    """`body` as a JSON response."""
    return web.json_response(text=body.model_dump_json(), status=status)
