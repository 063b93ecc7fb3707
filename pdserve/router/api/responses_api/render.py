"""A Responses answer: the Response object, or its stream of typed events.

The events come in the order the official client expects: `response.created`,
`response.in_progress`; per output item `response.output_item.added`, then for a message
`response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done`, or for a call `response.function_call_arguments.delta`...,
`response.function_call_arguments.done`; `response.output_item.done`; last
`response.completed` (or `.incomplete` when max_output_tokens cut it, `.failed` after an
`error`). Every event carries a `sequence_number`. A request answered whole is built by the
same state machine, fed the same pieces, so whole and streamed answers hold the same items.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import RootModel

from pdserve.router.api import responses
from pdserve.router.api.fanout import Piece
from pdserve.router.api.responses import ChoiceResult, Job
from pdserve.router.api.responses_api.models import ResponsesRequest


class JsonBody(RootModel[dict[str, Any]]):
    """A JSON object answered as it is."""


class ResponsesRender:
    """Builds one response's output items from its pieces, and the events that tell them."""

    def __init__(
        self,
        job: Job,
        req: ResponsesRequest,
        store: bool,
        on_done: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self._job = job
        self._req = req
        self._store = store
        self._on_done = on_done
        self._seq = 0
        self._items: list[dict[str, Any]] = []
        self._message: int | None = None  # the output index of the open message
        self._call: int | None = None  # the output index of the open function call
        self._begun = False
        self._ended = False
        self._error: dict[str, str] | None = None

    # ---- the Render protocol -------------------------------------------------------------

    def observe(self, piece: Piece) -> None:
        """Take a piece of a response answered whole."""
        self.events(piece)

    def events(self, piece: Piece) -> list[bytes]:
        """The events of one piece (the response's opening with its first)."""
        out = [] if self._begun else self._begin()
        if piece.text:
            out += self._text(piece.text)
        for call in piece.tool_calls:
            if call.id is not None:
                out += self._close()
                out += self._added({"id": "fc_" + call.id.removeprefix("call_"),
                                    "type": "function_call", "status": "in_progress",
                                    "call_id": call.id, "name": call.name or "",
                                    "arguments": ""})  # fmt: skip
                self._call = len(self._items) - 1
            if call.arguments:
                item = self._items[self._call if self._call is not None else -1]
                item["arguments"] += call.arguments
                out.append(self._event("response.function_call_arguments.delta",
                                       item_id=item["id"], output_index=self._call,
                                       delta=call.arguments))  # fmt: skip
        return out

    def whole(self, chosen: Sequence[ChoiceResult]) -> JsonBody:
        """The Response object of a request answered whole."""
        self._finish(chosen)
        return JsonBody(self.response(chosen, self._status(chosen)))

    def failed(self, message: str, type_: str, code: str | None = None) -> list[bytes]:
        """The `error` event of a stream that failed after its headers."""
        self._error = {"code": code or type_, "message": message}
        return [self._event("error", code=code or type_, message=message, param=None)]

    def closing(self, chosen: Sequence[ChoiceResult], ok: bool) -> list[bytes]:
        """The open items' closing events, then `response.completed` (or `.incomplete`,
        or `.failed` when the stream failed)."""
        if not ok:
            return [self._event("response.failed", response=self.response(chosen, "failed"))]
        out = self._finish(chosen)
        status = self._status(chosen)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        out.append(self._event(kind, response=self.response(chosen, status)))
        return out

    # ---- the response object -------------------------------------------------------------

    def response(self, chosen: Sequence[ChoiceResult], status: str) -> dict[str, Any]:
        """The Response object with the items so far and `status`."""
        req, job = self._req, self._job
        usage = responses.usage(job, chosen) if chosen else None
        body: dict[str, Any] = {
            "id": job.request_id,
            "object": "response",
            "created_at": job.created,
            "status": status,
            "model": req.model,
            "output": [dict(i) for i in self._items] if status != "in_progress" else [],
            "error": self._error if status == "failed" else None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": req.instructions,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tool_choice": (
                req.tool_choice.model_dump()
                if req.tool_choice is not None and not isinstance(req.tool_choice, str)
                else req.tool_choice or "auto"
            ),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id,
            "store": self._store,
            "text": req.text.model_dump(by_alias=True, exclude_none=True)
            if req.text is not None and req.text.format is not None
            else {"format": {"type": "text"}},
            "truncation": "disabled",
            "user": req.user,
            "usage": None,
        }
        if usage is not None and status != "in_progress":
            details = usage.prompt_tokens_details
            body["usage"] = {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {
                    "cached_tokens": details.cached_tokens if details is not None else 0
                },
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.total_tokens,
            }
        return body

    def _status(self, chosen: Sequence[ChoiceResult]) -> str:
        reason = chosen[0].finish_reason if chosen else None
        return "incomplete" if reason == "length" else "completed"

    # ---- items ---------------------------------------------------------------------------

    def _begin(self) -> list[bytes]:
        self._begun = True
        opening = self.response([], "in_progress")
        return [
            self._event("response.created", response=opening),
            self._event("response.in_progress", response=opening),
        ]

    def _text(self, text: str) -> list[bytes]:
        out = self._open_message() if self._message is None else []
        assert self._message is not None
        item = self._items[self._message]
        item["content"][0]["text"] += text
        out.append(self._event("response.output_text.delta", item_id=item["id"],
                               output_index=self._message, content_index=0, delta=text,
                               logprobs=[]))  # fmt: skip
        return out

    def _open_message(self) -> list[bytes]:
        out = self._close()
        n = sum(1 for i in self._items if i["type"] == "message")
        suffix = self._job.request_id.removeprefix("resp_") + (f"_{n}" if n else "")
        out += self._added({"id": f"msg_{suffix}", "type": "message", "status": "in_progress",
                            "role": "assistant", "content": []})  # fmt: skip
        self._message = len(self._items) - 1
        item = self._items[self._message]
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        out.append(self._event("response.content_part.added", item_id=item["id"],
                               output_index=self._message, content_index=0, part=dict(part)))  # fmt: skip
        return out

    def _added(self, item: dict[str, Any]) -> list[bytes]:
        self._items.append(item)
        return [self._event("response.output_item.added", output_index=len(self._items) - 1,
                            item=json.loads(json.dumps(item)))]  # fmt: skip

    def _close(self) -> list[bytes]:
        """Close the open message or call: its done events."""
        out = []
        if self._message is not None:
            index, self._message = self._message, None
            item = self._items[index]
            part = item["content"][0]
            out.append(self._event("response.output_text.done", item_id=item["id"],
                                   output_index=index, content_index=0, text=part["text"],
                                   logprobs=[]))  # fmt: skip
            out.append(self._event("response.content_part.done", item_id=item["id"],
                                   output_index=index, content_index=0, part=dict(part)))  # fmt: skip
            out += self._item_done(index)
        if self._call is not None:
            index, self._call = self._call, None
            item = self._items[index]
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=index, name=item["name"],
                                   arguments=item["arguments"]))  # fmt: skip
            out += self._item_done(index)
        return out

    def _item_done(self, index: int) -> list[bytes]:
        item = self._items[index]
        item["status"] = "completed"
        return [self._event("response.output_item.done", output_index=index, item=dict(item))]

    def _finish(self, chosen: Sequence[ChoiceResult]) -> list[bytes]:
        """Close what is open (an answer with no output at all gets an empty message)."""
        if self._ended:
            return []
        self._ended = True
        out = [] if self._begun else self._begin()
        if not self._items:
            out += self._open_message()
        out += self._close()
        if self._on_done is not None and chosen:
            self._on_done(self.response(chosen, self._status(chosen)))
        return out

    def _event(self, type_: str, **fields: Any) -> bytes:
        body = {"type": type_, **fields, "sequence_number": self._seq}
        self._seq += 1
        return f"event: {type_}\ndata: {json.dumps(body)}\n\n".encode()
