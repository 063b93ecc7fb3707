"""How a transfer's payload is cut into frames and mapped onto KV block memory. Pure.

A transfer's payload is its blocks laid end to end (`num_blocks * block_bytes` bytes). The
sender cuts it into chunks of at most `frame_bytes` (`split_payload`), whatever the block size:
a 8 MiB block under a 4 MiB target travels as two chunks, sixteen 64 KiB blocks as one. Each
side maps a chunk's byte range onto its own block views (`payload_views`), which yields slices
of KV memory: the sender hands them to the transport as a gather-write and the receiver lands
bytes straight into them, so neither side copies the payload or holds more than one frame's
worth of views at a time.

It knows byte offsets and memoryviews; not frames, sessions or sockets.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

# Default frame size: large enough that per-frame costs (header, checksum call, one await) are
# noise, small enough that a stalled frame is noticed within its deadline on a slow link.
DEFAULT_FRAME_BYTES = 4 << 20


def split_payload(payload_bytes: int, frame_bytes: int) -> Iterator[tuple[int, int]]:
    """(offset, length) of each chunk of a `payload_bytes` payload, in order, each at most
    `frame_bytes` long and together covering the payload exactly once."""
    if frame_bytes < 1:
        raise ValueError(f"frame_bytes must be >= 1, got {frame_bytes}")
    if payload_bytes < 0:
        raise ValueError(f"payload_bytes must be >= 0, got {payload_bytes}")
    for offset in range(0, payload_bytes, frame_bytes):
        yield offset, min(frame_bytes, payload_bytes - offset)


def payload_views(
    blocks: Sequence[memoryview], block_bytes: int, offset: int, num_bytes: int
) -> list[memoryview]:
    """The slices of `blocks` (each `block_bytes` long, flat bytes) that hold payload bytes
    `[offset, offset + num_bytes)`, in order. ValueError if the range leaves the payload."""
    end = offset + num_bytes
    if offset < 0 or num_bytes < 0 or end > len(blocks) * block_bytes:
        raise ValueError(
            f"byte range [{offset}, {end}) outside a payload of {len(blocks)} blocks of "
            f"{block_bytes} bytes"
        )
    views: list[memoryview] = []
    position = offset
    while position < end:
        index, start = divmod(position, block_bytes)
        stop = min(block_bytes, start + end - position)
        views.append(blocks[index][start:stop])
        position += stop - start
    return views
