"""A fake `BlockSender` for the checkpoint tests: records what would travel, sends nothing."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.worker.kv.outbox import Destination


class FakeSender:
    """Records each send (request id, tokens, block bytes) and its value digest."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.digests: list[bytes] = []
        self.sent: list[tuple[str, list[int], list[bytes]]] = []

    async def send(
        self,
        destination: Destination,
        request_id: str,
        token_ids: Sequence[int],
        blocks: Sequence[memoryview],
        timeout_s: float,
        value_digest: bytes = b"",
    ) -> int:
        self.digests.append(value_digest)
        self.sent.append((request_id, list(token_ids), [bytes(b) for b in blocks]))
        return len(blocks) * self.block_bytes
