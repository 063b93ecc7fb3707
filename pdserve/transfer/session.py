"""What both transfer sessions share: outbound messages, table lookups, and the chunk ledger.

A session (`SenderSession`, `ReceiverSession`) is a state machine with its allowed transitions
in one table, `{(state, event): next_state}`. `transition` is the only way a session moves:
a pair missing from the table raises IllegalTransition and the caller's state is untouched,
because the session assigns the returned state only after every check has passed.

`ChunkLedger` records which byte ranges of a transfer have been sent or received, so that both
sides agree, from chunk metadata alone, on coverage, byte counts and the commit digest.

Sessions are sans-I/O: they consume and produce Messages (plus envelopes), never bytes on a
socket; they know block indices within a transfer, not KV memory, leases or the scheduler.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

from pdserve.errors import (
    IllegalTransition,
)
from pdserve.transfer.codec import Envelope
from pdserve.transfer.messages import (
    Chunk,
    KVLayout,
    Message,
    NackCode,
    commit_digest,
)
from pdserve.transfer.wire import FingerprintValue

FingerprintMap = Mapping[str, FingerprintValue]
# (local, remote) -> {field: (local value, remote value)} for every differing field; empty when
# the two are interchangeable. None stands for a field one side does not have.
FingerprintCompare = Callable[[FingerprintMap, FingerprintMap], dict[str, tuple[object, object]]]

S = TypeVar("S", bound=Enum)
E = TypeVar("E", bound=Enum)


@dataclass(frozen=True, slots=True)
class Outbound:
    """A message a session wants sent, with the envelope to frame it in (`codec.encode`)."""

    envelope: Envelope
    message: Message


def fingerprint_diff(
    local: FingerprintMap, remote: FingerprintMap
) -> dict[str, tuple[object, object]]:
    """Every field whose value (or type: True is not 1 here) differs, or that one side lacks."""
    diff: dict[str, tuple[object, object]] = {}
    for name in sorted(set(local) | set(remote)):
        a, b = local.get(name), remote.get(name)
        if type(a) is not type(b) or a != b:
            diff[name] = (a, b)
    return diff


def transition(table: Mapping[tuple[S, E], S], state: S, event: E, who: str) -> S:
    """The next state for `event` in `state`, or IllegalTransition naming both."""
    try:
        return table[(state, event)]
    except KeyError:
        raise IllegalTransition(f"{who}: {event.name} is not allowed in {state.name}") from None


class ChunkLedger:
    """The chunks of one transfer attempt: byte ranges in bounds, never overlapping, each
    counted once; complete when they cover the whole payload."""

    def __init__(self, layout: KVLayout) -> None:
        self._payload_bytes = layout.payload_bytes
        self._starts: list[int] = []  # sorted offsets of every recorded chunk
        self._chunks: dict[int, Chunk] = {}
        self._num_bytes = 0

    def problem(self, chunk: Chunk) -> tuple[NackCode, str] | None:
        """Why `chunk` cannot be recorded (out of range or overlapping), or None if it can."""
        first, end = chunk.offset, chunk.offset + chunk.num_bytes
        if end > self._payload_bytes:
            return (
                NackCode.CHUNK_OUT_OF_RANGE,
                f"chunk bytes [{first}, {end}) outside the transfer's {self._payload_bytes}",
            )
        i = bisect_right(self._starts, first)
        neighbours = [
            self._chunks[self._starts[j]] for j in (i - 1, i) if 0 <= j < len(self._starts)
        ]
        for other in neighbours:
            other_end = other.offset + other.num_bytes
            if other.offset < end and first < other_end:
                return (
                    NackCode.CHUNK_OVERLAP,
                    f"chunk bytes [{first}, {end}) overlap [{other.offset}, {other_end})",
                )
        return None

    def add(self, chunk: Chunk) -> None:
        """Record a chunk that `problem` accepted."""
        reason = self.problem(chunk)
        if reason is not None:
            raise ValueError(reason[1])
        self._starts.insert(bisect_right(self._starts, chunk.offset), chunk.offset)
        self._chunks[chunk.offset] = chunk
        self._num_bytes += chunk.num_bytes

    @property
    def num_chunks(self) -> int:
        """Chunks recorded."""
        return len(self._chunks)

    @property
    def num_bytes(self) -> int:
        """Data bytes recorded."""
        return self._num_bytes

    @property
    def complete(self) -> bool:
        """True once every payload byte is covered (exactly once, by construction)."""
        return self._num_bytes == self._payload_bytes

    def digest(self) -> int:
        """The commit digest of the recorded chunks (`messages.commit_digest`)."""
        return commit_digest(self._chunks.values())
