"""Stop strings over streamed text: hold back what may be the start of a stop string.

Semantics (independent of how the text is cut into deltas): the output is the full text cut
just before the first stop string to *complete*, i.e. the occurrence with the smallest end;
among stop strings ending at the same place, the longest (earliest start) wins.

Why holding back suffices: after each delta the matcher keeps unreleased only the longest
suffix that is a proper prefix of some stop string. An occurrence completing later either lies
wholly in the held text plus new text, or started in released text, which would make a longer
held suffix — a contradiction. So released text is never part of a stop string. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed text deltas; get back the text that is safe to send to the client.

    `include_stop` (vLLM's include_stop_str_in_output) keeps the stop string in the output.
    `feed(..., can_stop=False)` (before min_tokens tokens exist) looks for no stop string but
    still holds back a possible beginning: an occurrence that starts before the min_tokens
    boundary and ends after it counts, one that ended before it does not (vLLM's semantics).
    """

    def __init__(self, stop: Sequence[str], include_stop: bool = False) -> None:
        self._stop = tuple(s for s in stop if s)
        self._include = include_stop
        self._held = ""
        self.stopped = False

    def feed(self, text: str, can_stop: bool = True) -> str:
        """Text releasable after `text`; sets `stopped` (and returns the text before the stop
        string, or through it with `include_stop`) once one completes. Nothing is released
        after that."""
        if self.stopped:
            return ""
        buffer = self._held + text
        # An occurrence inside the held text alone would have been found when it was fed
        # (or fell before min_tokens): only those ending in the new text count.
        hit = first_stop_span(buffer, self._stop, len(self._held)) if can_stop else None
        if hit is not None:
            self.stopped = True
            self._held = ""
            return buffer[: hit[1] if self._include else hit[0]]
        keep = held_suffix_len(buffer, self._stop)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Everything still held (the stream ended without a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


def first_stop_span(text: str, stop: Sequence[str], min_end: int = 0) -> tuple[int, int] | None:
    """(start, end) of the first-completing stop string in `text` ending after `min_end`
    (see module docstring), or None."""
    best: tuple[int, int] | None = None  # (end, start)
    for s in stop:
        start = text.find(s, max(0, min_end - len(s) + 1))
        if start >= 0:
            key = (start + len(s), start)
            if best is None or key < best:
                best = key
    return None if best is None else (best[1], best[0])


def first_stop(text: str, stop: Sequence[str]) -> int | None:
    """Start of the first-completing stop string in `text` (see module docstring), or None."""
    span = first_stop_span(text, stop)
    return None if span is None else span[0]


def held_suffix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if s.startswith(text[len(text) - k :]):
                best = k
                break
    return best


def truncate_at_stop(text: str, stop: Sequence[str]) -> str:
    """Reference semantics on a whole text: `text` cut at its first-completing stop string."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stop if s and text[:end].endswith(s)]
        if ending:
            return text[: end - max(len(s) for s in ending)]
    return text
