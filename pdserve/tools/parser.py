"""Generated text -> content and OpenAI tool-call deltas, as tokens arrive. Pure.

One parser per choice, fed each piece of detokenized text. It is streaming-safe: text that
may still become a call (a partial `<tool_call>` tag, a body not yet closed) is held back, so
no half call leaks into `content`; a call's first delta carries its id and whole name, then
its arguments follow in pieces, exactly as the model writes them (their concatenation is the
call's `arguments`). What it returns depends only on the text, never on how it was cut into
pieces, so a streamed and a whole response, or a stream resumed on another worker, agree.

Bodies are scanned as JSON (depth, strings, escapes): the arguments value ends where its
brackets close, the call where the body's do. A body whose keys come in another order, or
that is not the expected shape, is read once it closes (`json.loads`), then sent whole; one
that is not a call at all is text after all. Whitespace right around calls is dropped (a
model's newline before `<tool_call>` is not content).
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.tools.formats import ToolFormat

# `{"name": "<name>", "arguments": ` (or "parameters"): where a call's arguments begin.
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of call `index`: its first carries `id` and `name`, later ones arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class ParsedDelta:
    """What one piece of text added: content and call pieces."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class _State(enum.Enum):
    TEXT = "text"  # content; watching for a call's start
    TEXT_ONLY = "text_only"  # content to the end (a format whose calls only open the output)
    OPENED = "opened"  # a call's opener seen; its `{` not yet
    BODY = "body"  # inside a call's JSON body
    AFTER = "after"  # a body closed; its closer or the next call's separator may follow


class _Value(enum.Enum):
    CONTAINER = "container"
    STRING = "string"
    SCALAR = "scalar"


class ToolCallParser:
    """Splits one choice's output into content and tool calls in `fmt`."""

    def __init__(self, fmt: ToolFormat, new_id: Callable[[], str]) -> None:
        self._fmt = fmt
        self._new_id = new_id
        self._open_tag = fmt.opener.strip()
        self._close_tag = fmt.closer.strip()
        self._state = _State.TEXT
        self._buf = ""  # text not yet consumed
        self._pending_ws = ""  # trailing content whitespace, held in case a call follows
        self._out = ParsedDelta()
        self.num_calls = 0
        self._start_body()

    def _start_body(self) -> None:
        self._raw = ""  # the current call's text so far, for when it turns out to be text
        self._body = ""
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._head = False  # the call's id and name were sent
        self._value: _Value | None = None  # the arguments value's kind, once it began
        self._value_done = False

    # ---- the interface ------------------------------------------------------------------

    def feed(self, text: str) -> ParsedDelta:
        """What `text` (the next piece of output) adds."""
        self._buf += text
        self._run()
        return self._take()

    def finish(self) -> ParsedDelta:
        """What is left once the output ended: held text that never became a call."""
        if self._state in (_State.TEXT, _State.TEXT_ONLY):
            # A partial opener, or (calls only opening the output) blank text so far: text.
            self._content(self._buf)
        elif self._state is _State.OPENED or (self._state is _State.BODY and not self._head):
            self._content(self._raw)
        # BODY with its head sent: a call cut short (max_tokens); AFTER: a partial closer.
        self._buf = ""
        if self.num_calls == 0:
            self._out.content += self._pending_ws
        self._pending_ws = ""
        return self._take()

    # ---- the state machine --------------------------------------------------------------

    def _run(self) -> None:
        while self._buf:
            before = (self._state, len(self._buf))
            {
                _State.TEXT: self._text,
                _State.TEXT_ONLY: self._text_only,
                _State.OPENED: self._opened,
                _State.BODY: self._body_chars,
                _State.AFTER: self._after,
            }[self._state]()
            if (self._state, len(self._buf)) == before:
                return  # waiting for more text

    def _text_only(self) -> None:
        self._content(self._buf)
        self._buf = ""

    def _text(self) -> None:
        if not self._fmt.anywhere:
            self._leading()
            return
        at = self._buf.find(self._open_tag)
        if at >= 0:
            self._content(self._buf[:at])
            self._raw = self._buf[at : at + len(self._open_tag)]
            self._buf = self._buf[at + len(self._open_tag) :]
            self._state = _State.OPENED
            return
        keep = _partial_suffix(self._buf, self._open_tag)
        self._content(self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]

    def _leading(self) -> None:
        # Calls only open the output: decide from its first non-blank text.
        rest = self._buf.lstrip()
        for tag in self._fmt.preamble:
            if tag.startswith(rest):
                return  # blank, or a partial preamble: wait
            if rest.startswith(tag):
                rest = rest[len(tag) :].lstrip()
        if not rest:
            return
        if rest.startswith("{"):
            # What came before the body (blank, a preamble) is text if the body is not a call.
            self._raw = self._buf[: len(self._buf) - len(rest)]
            self._buf = rest
            self._state = _State.OPENED
        else:
            self._state = _State.TEXT_ONLY

    def _opened(self) -> None:
        rest = self._buf.lstrip()
        self._raw += self._buf[: len(self._buf) - len(rest)]
        self._buf = rest
        if not rest:
            return
        if rest.startswith("{"):
            self._state = _State.BODY
            return
        self._not_a_call()

    def _body_chars(self) -> None:
        used = 0
        for ch in self._buf:
            used += 1
            self._raw += ch
            self._body += ch
            self._char(ch)
            if self._depth == 0:
                self._body_done()
                break
        self._buf = self._buf[used:]

    def _after(self) -> None:
        rest = self._buf.lstrip()
        if not rest:
            self._buf = ""
            return
        if self._close_tag:
            if rest.startswith(self._close_tag):
                self._buf = rest[len(self._close_tag) :]
                self._state = _State.TEXT
            elif self._close_tag.startswith(rest):
                return  # a partial closer
            else:
                self._buf = rest
                self._state = _State.TEXT
            return
        sep = self._fmt.separator.strip()
        if sep and rest.startswith(sep):
            self._buf = rest[len(sep) :]
            self._raw = sep  # text again if no call follows
            self._state = _State.OPENED
        else:
            self._buf = rest
            self._state = _State.TEXT_ONLY

    # ---- one body -----------------------------------------------------------------------

    def _char(self, ch: str) -> None:
        """Advance the JSON scan by `ch`, sending the arguments as they pass."""
        if not self._head and self._depth == 1 and not self._in_str and ch == ":":
            self._try_head()
            self._step(ch)
            return
        depth, in_str = self._depth, self._in_str
        self._step(ch)
        if not self._head or self._value_done:
            return
        if self._value is None:
            if ch.isspace():
                return
            self._value = (
                _Value.CONTAINER if ch in "{[" else _Value.STRING if ch == '"' else _Value.SCALAR
            )
            self._arguments(ch)
            return
        if self._value is _Value.SCALAR and not in_str and (ch in ",}]" or ch.isspace()):
            self._value_done = True
            return
        self._arguments(ch)
        closed = self._depth == 1 and depth == 2  # the container's last bracket
        ended = in_str and not self._in_str  # the string's closing quote
        if closed if self._value is _Value.CONTAINER else ended:
            self._value_done = True

    def _step(self, ch: str) -> None:
        if self._in_str:
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._in_str = False
        elif ch == '"':
            self._in_str = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1

    def _try_head(self) -> None:
        match = _HEAD.fullmatch(self._body)
        if match is None:
            return
        try:
            name = json.loads(f'"{match.group(1)}"')
        except ValueError:
            return
        self._send_head(name)

    def _send_head(self, name: str) -> None:
        self._head = True
        self._pending_ws = ""  # blank text before a call is not content
        self._out.calls.append(ToolCallDelta(self.num_calls, "", self._new_id(), name))
        self.num_calls += 1

    def _arguments(self, text: str) -> None:
        calls = self._out.calls
        index = self.num_calls - 1
        if calls and calls[-1].index == index and calls[-1].id is None:
            calls[-1] = ToolCallDelta(index, calls[-1].arguments + text)
        else:
            calls.append(ToolCallDelta(index, text))

    def _body_done(self) -> None:
        if not self._head:
            call = _as_call(self._body)
            if call is None:
                self._not_a_call()
                return
            name, arguments = call
            self._send_head(name)
            self._arguments(arguments)
        self._start_body()
        self._state = _State.AFTER

    def _not_a_call(self) -> None:
        # What looked like a call is text: everything from its opener on.
        text = self._raw
        self._start_body()
        self._content(text)
        self._state = _State.TEXT if self._fmt.anywhere else _State.TEXT_ONLY

    # ---- output -------------------------------------------------------------------------

    def _content(self, text: str) -> None:
        if not text:
            return
        body = text.rstrip()
        if body:
            self._out.content += self._pending_ws + body
            self._pending_ws = text[len(body) :]
        else:
            self._pending_ws += text

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, ParsedDelta()
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that `tag` starts with (a tag half written)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _as_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a whole body, or None when it is not a call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        return obj["name"], args
    if isinstance(args, dict):
        return obj["name"], json.dumps(args, ensure_ascii=False)
    return None
