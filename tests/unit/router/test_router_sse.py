"""SSE framing and OpenAI request models."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pdserve.router.api import sse
from pdserve.router.api.openai_models import (
    ChatCompletionRequest,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)


def test_event_framing_and_parse_round_trip() -> None:
    chunk = CompletionResponse(
        id="cmpl-1", created=1, model="m", choices=[CompletionChoice(text="a\nb")]
    )
    raw = sse.encode_event(chunk) + sse.DONE
    assert raw.startswith(b"data: {") and raw.endswith(b"\n\ndata: [DONE]\n\n")
    assert raw.count(b"\n\n") == 2  # newlines in text are escaped inside the JSON
    events = sse.parse_events(raw)
    assert events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["text"] == "a\nb"


def test_request_models() -> None:
    req = CompletionRequest.model_validate(
        {"model": "m", "prompt": [1, 2], "stop": "x", "logprobs": None}
    )
    assert req.stop_list() == ["x"] and req.prompt == [1, 2] and not req.include_usage
    # Unknown fields are refused (the top-level ones by field_policy first, naming them).
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "unknown": 1})
    batch = CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2], [3]]})
    assert batch.prompt == [[1, 2], [3]]
    with pytest.raises(ValidationError):  # token ids are integers, not numeric strings
        CompletionRequest.model_validate({"model": "m", "prompt": [["1"]]})
    parts = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    )  # fmt: skip
    assert parts.messages[0].text() == "a\nb"
    chat = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}],
         "stream": True, "stream_options": {"include_usage": True}}
    )  # fmt: skip
    assert chat.include_usage and chat.stop_list() == []
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m"})  # no prompt
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": []})
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": "lots"})
