"""Frames over a `ByteStream`: the thin I/O layer between the sans-I/O codec and a transport.

`read_frame` reads a header and its small body; Chunk data is left in the stream for the caller
to land straight into KV memory with `read_data_into` (no intermediate payload buffer).
`write_frame` hands the codec's buffer list to the transport as one gather-write.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.transfer.codec import HEADER_BYTES, FrameHeader, decode_body, decode_header, encode
from pdserve.transfer.messages import Message
from pdserve.transfer.session import Outbound
from pdserve.transfer.stream import Buffer, ByteStream


async def write_frame(
    stream: ByteStream,
    outbound: Outbound,
    data: Sequence[Buffer] | None = None,
    verify_data: bool = True,
) -> None:
    """Send one framed message (and a Chunk's data buffers, uncopied).

    `verify_data=False` skips the codec's second checksum pass when the caller has just
    computed the Chunk's payload checksum over the same buffers.
    """
    frame = encode(outbound.message, data, envelope=outbound.envelope, verify_data=verify_data)
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


async def read_data_into(stream: ByteStream, views: Sequence[memoryview]) -> None:
    """Land the data that follows a Chunk header straight into `views`, in order."""
    for view in views:
        await stream.receive_into(view)


async def discard_data(stream: ByteStream, num_bytes: int) -> None:
    """Read and drop `num_bytes` of data (a refused chunk's payload)."""
    scratch = memoryview(bytearray(min(num_bytes, 1 << 20)))
    while num_bytes > 0:
        n = min(num_bytes, len(scratch))
        await stream.receive_into(scratch[:n])
        num_bytes -= n
