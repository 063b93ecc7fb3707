"""Shared by the vLLM conformance tests (issue 33): fake workers for either layout, a chat
body, SSE events."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fake_worker import FakeWorker

from pdserve.router.api import sse

TOKENS = [300, 301, 302, 303, 304]
# Each case runs colocated and disaggregated: the answers must not depend on the path.
MODES = pytest.mark.parametrize("mode", ["colocated", "disagg"])


def workers(mode: str) -> list[FakeWorker]:
    """Fake workers serving `mode`: one `both` worker, or a prefill and a decode worker."""
    if mode == "colocated":
        return [FakeWorker("both", TOKENS)]
    return [FakeWorker("prefill", TOKENS), FakeWorker("decode", TOKENS)]


def events(raw: bytes) -> list[dict[str, Any]]:
    """The JSON events of an SSE body, without the final [DONE]."""
    return [json.loads(e) for e in sse.parse_events(raw)[:-1]]


def chat(**kw: Any) -> dict[str, Any]:
    """A greedy /v1/chat/completions body."""
    return {"model": "tiny-v2", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "temperature": 0, **kw}  # fmt: skip
