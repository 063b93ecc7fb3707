"""`FrameDecoder`: feed it bytes in any split, get complete frames back (sans-I/O).

For control traffic and tests; the KV data path reads headers and bodies with `decode_header`
and `decode_body` and lands data in KV blocks itself. Life cycle: `feed` any number of times,
then `feed_eof` when the stream ends; a partial frame left at EOF is `FrameTruncated`.

Invariants:
- Nothing is allocated on a peer's say-so: the buffer holds only bytes actually fed, and a
  header's lengths are checked against the bounds (FrameTooLarge) as soon as it is complete.
- Garbage fails fast: a wrong first byte is BadMagic before a whole header has arrived.
- After any ProtocolError the stream has lost framing; the decoder refuses further input.

This module knows frames only: no sockets, no asyncio, no sessions.
"""

from __future__ import annotations

from pdserve.errors import BadMagic, FrameTruncated, ProtocolError
from pdserve.transfer.codec import (
    HEADER_BYTES,
    MAGIC,
    MAX_BODY_BYTES,
    MAX_DATA_BYTES,
    Frame,
    FrameHeader,
    decode_body,
    decode_header,
    verify_data,
)


class FrameDecoder:
    """Incremental frame parser; each `feed` returns the frames it completed, in order."""

    def __init__(
        self, *, max_body_bytes: int = MAX_BODY_BYTES, max_data_bytes: int = MAX_DATA_BYTES
    ) -> None:
        self._max_body = max_body_bytes
        self._max_data = max_data_bytes
        self._buf = bytearray()
        self._header: FrameHeader | None = None  # parsed header of the frame in progress
        self._failed: ProtocolError | None = None

    @property
    def num_buffered(self) -> int:
        """Bytes received that are not yet part of a returned frame."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Append `data` and return every frame it completes; raises a ProtocolError subclass."""
        if self._failed is not None:
            raise ProtocolError(f"decoder already failed: {self._failed}")
        self._buf += data
        frames: list[Frame] = []
        try:
            while (frame := self._next_frame()) is not None:
                frames.append(frame)
        except ProtocolError as e:
            self._failed = e
            raise
        return frames

    def feed_eof(self) -> None:
        """The stream ended: FrameTruncated if it ended inside a frame."""
        if self._failed is not None:
            raise ProtocolError(f"decoder already failed: {self._failed}")
        if self._buf:
            self._failed = FrameTruncated(f"stream ended {len(self._buf)} bytes into a frame")
            raise self._failed

    def _next_frame(self) -> Frame | None:
        if self._header is None:
            prefix = bytes(self._buf[: len(MAGIC)])
            if prefix != MAGIC[: len(prefix)]:
                raise BadMagic(f"frame starts with {prefix!r}, expected {MAGIC!r}")
            if len(self._buf) < HEADER_BYTES:
                return None
            self._header = decode_header(
                self._buf, max_body_bytes=self._max_body, max_data_bytes=self._max_data
            )
        header = self._header
        body_end = HEADER_BYTES + header.body_len
        frame_end = body_end + header.data_len
        if len(self._buf) < frame_end:
            return None
        message = decode_body(header, bytes(self._buf[HEADER_BYTES:body_end]))
        data = bytes(self._buf[body_end:frame_end])
        if header.data_len:
            verify_data(header, [data])
        del self._buf[:frame_end]
        self._header = None
        return Frame(header, message, data)
