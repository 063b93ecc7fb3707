"""The shm and NIXL handshakes run before any cluster MAC: a peer's length field must not make
this side allocate or wait for a tail it then reads. An oversized tail is refused unread."""

from __future__ import annotations

import asyncio
import struct

import pytest
from memory_streams import memory_stream_pair

from pdserve.errors import ProtocolError
from pdserve.transfer import nixl_transport, shm

pytestmark = pytest.mark.timeout(30)


async def _refused_unread(connect: object, header: bytes) -> ProtocolError:
    mine, peer = memory_stream_pair()
    # The peer sends its header and nothing after it: reading the announced tail would wait
    # forever, so the refusal must come from the length alone.
    await peer.send([header])
    with pytest.raises(ProtocolError) as caught:
        async with asyncio.timeout(10):
            await connect(mine)  # type: ignore[operator]
    await mine.aclose()
    await peer.aclose()
    return caught.value


def test_an_shm_peer_announcing_a_long_segment_name_is_refused_unread() -> None:
    header = struct.pack("<4sHHIQH", b"PDSM", 2, 0, 4, 1 << 20, 300)
    before = shm.leaked_segments()
    exc = asyncio.run(_refused_unread(shm.connect_shm, header))
    assert "segment name of 300 bytes" in str(exc)
    assert shm.leaked_segments() == before  # its own inbox segment went too


@pytest.mark.skipif(not nixl_transport.nixl_available(), reason="nixl is not importable here")
def test_a_nixl_peer_announcing_huge_agent_metadata_is_refused_unread() -> None:
    huge = (1 << 32) - 1
    header = struct.pack("<4sHHIQQI", b"PDNX", 1, 0, 4, 1 << 20, 0, huge)
    exc = asyncio.run(_refused_unread(nixl_transport.connect_nixl, header))
    assert f"agent metadata of {huge} bytes" in str(exc)
