"""What writes a request's answer: whole, or as the events of a stream (`chat_render` for
completions and chat, `responses_api.render` for the Responses API)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from pydantic import BaseModel

from pdserve.router.api.fanout import ChoiceRun, Piece
from pdserve.router.api.responses import ChoiceResult, Job


class Render(Protocol):
    """Writes one request's answer: whole, or as the events of a stream."""

    def observe(self, piece: Piece) -> None: ...
    def events(self, piece: Piece) -> list[bytes]: ...
    def whole(self, chosen: Sequence[ChoiceResult]) -> BaseModel: ...
    def failed(self, message: str, type_: str, code: str | None = None) -> list[bytes]: ...
    def closing(self, chosen: Sequence[ChoiceResult], ok: bool) -> list[bytes]: ...


RenderFactory = Callable[[Job, list[ChoiceRun]], Render]
