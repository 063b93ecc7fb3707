"""Which blocks cross between a staged KV cache's device memory and its host mirror, and when.

A staged cache (`KVCache.staged`: a GPU engine, or a CPU one with `kv_host_staging` in tests)
is read and written by the transports through a host mirror. This bookkeeping, owned by the
engine, decides the copies at the hand-over points:
- views handed out to *read* a request's KV (a prefill result being sent, a checkpoint or
  prefix-pull snapshot) are staged out first;
- views handed out to *write* (a remote request's blocks, an import) are recorded per owner;
  `landed(owner)` stages exactly those in once the bytes are verified, before anything on the
  device reads them (the KV canary, the first decode step, the prefix cache);
- blocks the owner already had from this engine's prefix cache are never staged in: their
  mirror holds nothing current, and other requests share them.
Without staging every call here is free and views are the cache's own memory.

What crosses the mirror is counted (`staged_blocks`, by direction): the host mirror is the
fallback path for KV between workers on GPUs, and a fallback is never silent.
"""

from __future__ import annotations

from pdserve.engine.kv_cache import KVCache


class KVStaging:
    """Device <-> host-mirror copies for the transfer layer's views of a KV cache."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        # owner (request or import id) -> blocks written through the mirror, not yet staged in.
        self._landing: dict[str, list[int]] = {}
        # Blocks copied device -> mirror ("out", to be sent) and mirror -> device ("in").
        self.staged_blocks: dict[str, int] = {"out": 0, "in": 0}

    def read_views(self, block_ids: list[int]) -> list[memoryview]:
        """Views of these blocks holding their current KV (staged out first)."""
        if self.cache.staged:
            self.cache.stage_out(block_ids)
            self.staged_blocks["out"] += len(block_ids)
        return self.cache.block_views(block_ids)

    def write_views(self, owner: str, block_ids: list[int], skip: int = 0) -> list[memoryview]:
        """Views of all these blocks for a transfer to write; the blocks after the first `skip`
        (which this engine already holds current) are staged in at `landed(owner)`."""
        if self.cache.staged:
            self._landing[owner] = list(block_ids[skip:])
        return self.cache.block_views(block_ids)

    def landed(self, owner: str) -> None:
        """The owner's written blocks are complete and verified: copy them to the device
        (once; later calls for the same owner do nothing)."""
        blocks = self._landing.pop(owner, None)
        if blocks:
            self.cache.stage_in(blocks)
            self.staged_blocks["in"] += len(blocks)

    def staged_bytes(self) -> dict[str, int]:
        """Bytes copied through the mirror so far, by direction; empty for an unstaged cache."""
        if not self.cache.staged:
            return {}
        return {d: n * self.cache.block_bytes for d, n in self.staged_blocks.items()}

    def forget(self, owner: str) -> None:
        """The owner's blocks were freed unused: nothing to stage in."""
        self._landing.pop(owner, None)

    @property
    def num_pending(self) -> int:
        """Owners with written blocks not yet staged in (a leak check for tests)."""
        return len(self._landing)
