"""Frames over a `ByteStream`: the thin I/O layer between the sans-I/O codec and a transport.

`read_frame` reads a header and its small body; Chunk and Put data is left in the stream for
the caller to land straight into KV memory with `read_data_into`, hashed as it lands (no
intermediate payload buffer, no second pass).
`write_frame` hands the codec's buffer list to the transport as one gather-write.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import xxhash

from pdserve.transfer.codec import HEADER_BYTES, FrameHeader, decode_body, decode_header, encode
from pdserve.transfer.messages import Message
from pdserve.transfer.session import Outbound
from pdserve.transfer.stream import Buffer, ByteStream

# Bytes landed per receive call, each followed by a hash update and the caller's `on_piece`
# (the KV receiver renews a lease there): often enough that a slow chunk still shows progress,
# rarely enough that neither costs anything.
PROGRESS_BYTES = 1 << 20


async def write_frame(
    stream: ByteStream,
    outbound: Outbound,
    data: Sequence[Buffer] | None = None,
    verify_data: bool = True,
    checksum: int | None = None,
) -> None:
    """Send one framed message (and a Chunk's data buffers, uncopied).

    `verify_data=False` skips the codec's second checksum pass when the caller has just
    computed the Chunk's payload checksum over the same buffers.
    """
    frame = encode(
        outbound.message,
        data,
        envelope=outbound.envelope,
        verify_data=verify_data,
        checksum=checksum,
    )
    await stream.send(frame)


async def read_frame(stream: ByteStream) -> tuple[FrameHeader, Message]:
    """Read one header and body; a Chunk's `header.data_len` bytes of data follow in the stream."""
    head = bytearray(HEADER_BYTES)
    await stream.receive_into(memoryview(head))
    header = decode_header(head)
    body = bytearray(header.body_len)
    if header.body_len:
        await stream.receive_into(memoryview(body))
    return header, decode_body(header, bytes(body))


async def read_data_into(
    stream: ByteStream,
    views: Sequence[memoryview],
    timeout_s: float,
    on_piece: Callable[[], object] | None = None,
) -> int:
    """Land the data that follows a header straight into `views`, in order, in pieces of at
    most `PROGRESS_BYTES`, each within `timeout_s` (else TimeoutError); returns the xxh3_64 of
    all of it. Each piece is hashed as it lands, while still in cache (the same digest as one
    pass afterwards, without that pass); `on_piece` runs after each."""
    hasher = xxhash.xxh3_64()
    for view in views:
        for start in range(0, view.nbytes, PROGRESS_BYTES):
            piece = view[start : start + PROGRESS_BYTES]
            async with asyncio.timeout(timeout_s):
                await stream.receive_into(piece)
            hasher.update(piece)
            if on_piece is not None:
                on_piece()
    return hasher.intdigest()


async def discard_data(stream: ByteStream, num_bytes: int) -> None:
    """Read and drop `num_bytes` of data (a refused chunk's payload)."""
    scratch = memoryview(bytearray(min(num_bytes, 1 << 20)))
    while num_bytes > 0:
        n = min(num_bytes, len(scratch))
        await stream.receive_into(scratch[:n])
        num_bytes -= n
