"""Server-sent events framing for OpenAI streaming: `data: <json>\n\n`, then `data: [DONE]`.

Pure: bytes out, no I/O. JSON is compact and on one line (pydantic never emits raw newlines in
JSON strings), so one event is always one `data:` line.
"""

from __future__ import annotations

from pydantic import BaseModel

DONE = b"data: [DONE]\n\n"
CONTENT_TYPE = "text/event-stream"


def encode_event(body: BaseModel) -> bytes:
    """One SSE event carrying `body` as JSON."""
    return b"data: " + body.model_dump_json().encode() + b"\n\n"


def parse_events(raw: bytes) -> list[str]:
    """The `data:` payloads of a whole SSE body, in order (for clients and tests)."""
    events = []
    for block in raw.decode().split("\n\n"):
        lines = [ln[len("data:") :].strip() for ln in block.split("\n") if ln.startswith("data:")]
        if lines:
            events.append("\n".join(lines))
    return events
