"""KV block accounting: free queue, reference counts and the prefix cache.

Pure bookkeeping over block ids; it never touches KV memory, sockets or time.

Invariants (checked by `check_invariants`, which the tests call after every operation):
- A block is either referenced (ref_count > 0, owned by one or more requests) or in the free
  queue (ref_count == 0), never both.
- A full block whose KV has been computed may carry a prefix hash; `cached` maps each hash to
  exactly one block. A cached block with ref_count 0 stays in the free queue and can be revived
  by a later request with the same prefix until it is evicted.
- Eviction order is the free queue order: blocks without a hash (worthless) sit at the head,
  cached blocks are appended to the tail when freed, a request's last block first, so the
  longest-lived prefixes are evicted last (LRU over prefixes).

Prefix hashes are chained: hash(block i) = xxh3_64(hash(block i-1) || token ids of block i), so
equal hashes mean equal whole prefixes, not just equal blocks. The hash is deterministic across
processes, so a router can compute the same keys.

With a `KVEventLog`, every change of `cached` is also published: `stored` when hashes are
registered, `evicted` when `allocate_slots` reuses cached blocks (one event per call, in
eviction order), `cleared` on `reset_prefix_cache`. Applying them in order rebuilds `cached`'s
keys exactly (tests check it after random operations).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

from pdserve.engine.kv_events import KVEventKind, KVEventLog
from pdserve.errors import EngineError

_ROOT_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: list[int] | tuple[int, ...]) -> int:
    """Chained prefix hash of one full block."""
    h = xxhash.xxh3_64(parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


def prefix_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Hashes of every full block of `token_ids`, in order."""
    hashes: list[int] = []
    parent = _ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class BlockManager:
    """Allocates KV blocks to requests, shares cached prefix blocks, evicts in LRU order."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        events: KVEventLog | None = None,
    ):
        if num_blocks < 1 or block_size < 1:
            raise EngineError(f"BlockManager: num_blocks={num_blocks} block_size={block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_count = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        # Insertion order is eviction order (head evicted first); values unused.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, int] = {}
        self._req_blocks: dict[str, list[int]] = {}
        # Hashes of the request's full blocks already registered in the cache, in order.
        self._req_hashes: dict[str, list[int]] = {}
        self.num_cache_queries_tokens = 0
        self.num_cache_hit_tokens = 0
        # Where changes of `cached` are published (None: nowhere).
        self.events = events
        # Hashes evicted by the allocation in progress, published once it is done.
        self._evicted: list[int] = []

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation may take (includes evictable cached blocks)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (empty if it holds none)."""
        return self._req_blocks.get(request_id, [])

    def free_queue(self) -> list[int]:
        """Free block ids in eviction order (for tests and debugging)."""
        return list(self._free)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ----------------------------------------------------------------------

    def get_computed_blocks(self, token_ids: list[int]) -> tuple[list[int], int]:
        """Cached blocks for the longest cached prefix of `token_ids`, and their token count.

        At least one token is always left to compute, because the step that computes it is the
        one that samples the next token.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        blocks: list[int] = []
        for h in prefix_block_hashes(token_ids[: max_blocks * self.block_size], self.block_size):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            blocks.append(block_id)
        self.num_cache_queries_tokens += len(token_ids)
        self.num_cache_hit_tokens += len(blocks) * self.block_size
        return blocks, len(blocks) * self.block_size

    def cache_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Register the request's full blocks whose KV is now computed (and verified)."""
        if not self.enable_prefix_caching:
            return
        blocks = self._req_blocks.get(request_id)
        if blocks is None:
            return
        hashes = self._req_hashes.setdefault(request_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        parent = hashes[-1] if hashes else _ROOT_HASH
        stored: list[int] = []
        for i in range(len(hashes), num_full):
            start = i * self.block_size
            parent = hash_block_tokens(parent, token_ids[start : start + self.block_size])
            hashes.append(parent)
            block_id = blocks[i]
            if parent not in self.cached and self._block_hash[block_id] is None:
                self.cached[parent] = block_id
                self._block_hash[block_id] = parent
                stored.append(parent)
        if self.events is not None:
            self.events.append(KVEventKind.STORED, stored)

    # ---- allocation ----------------------------------------------------------------------

    def can_allocate(self, num_new_blocks: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Whether `num_new_blocks` fresh blocks fit after reviving `computed_blocks`."""
        revived = sum(1 for b in computed_blocks if self._ref_count[b] == 0)
        return num_new_blocks + revived <= len(self._free)

    def allocate_slots(
        self,
        request_id: str,
        num_total_tokens: int,
        computed_blocks: list[int] | None = None,
    ) -> bool:
        """Grow the request's block table to cover `num_total_tokens` tokens.

        `computed_blocks` (prefix-cache hits, only on a request's first allocation) are shared,
        not copied. Returns False, changing nothing, when the free queue is too short.
        """
        computed_blocks = computed_blocks or []
        blocks = self._req_blocks.get(request_id, [])
        if computed_blocks and blocks:
            raise EngineError(f"request {request_id}: prefix blocks on a non-empty block table")
        num_new = self.num_blocks_needed(num_total_tokens) - len(blocks) - len(computed_blocks)
        num_new = max(num_new, 0)
        if not self.can_allocate(num_new, computed_blocks):
            return False
        for block_id in computed_blocks:
            self._touch(block_id)
        new_blocks = [self._pop_free() for _ in range(num_new)]
        if self._evicted:
            evicted, self._evicted = self._evicted, []
            if self.events is not None:
                self.events.append(KVEventKind.EVICTED, evicted)
        self._req_blocks[request_id] = blocks + list(computed_blocks) + new_blocks
        if computed_blocks:
            self._req_hashes[request_id] = [
                h for h in (self._block_hash[b] for b in computed_blocks) if h is not None
            ]
        return True

    def free(self, request_id: str) -> int:
        """Drop the request's references; returns how many blocks became free."""
        blocks = self._req_blocks.pop(request_id, [])
        self._req_hashes.pop(request_id, None)
        num_freed = 0
        # Reverse order: a request's tail blocks are the least likely to be shared, so they are
        # queued ahead of its head blocks and evicted first.
        for block_id in reversed(blocks):
            self._ref_count[block_id] -= 1
            if self._ref_count[block_id] == 0:
                num_freed += 1
                self._free[block_id] = None
                if self._block_hash[block_id] is None:
                    self._free.move_to_end(block_id, last=False)
        return num_freed

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their KV but become unshareable)."""
        for block_id in self.cached.values():
            self._block_hash[block_id] = None
        self.cached.clear()
        self._req_hashes.clear()
        if self.events is not None:
            self.events.append(KVEventKind.CLEARED)

    # ---- internals -----------------------------------------------------------------------

    def _touch(self, block_id: int) -> None:
        if self._ref_count[block_id] == 0:
            del self._free[block_id]
        self._ref_count[block_id] += 1

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        evicted = self._block_hash[block_id]
        if evicted is not None:
            del self.cached[evicted]
            self._block_hash[block_id] = None
            self._evicted.append(evicted)
        self._ref_count[block_id] = 1
        return block_id

    def check_invariants(self) -> None:
        """Raise AssertionError-like EngineError if the accounting is inconsistent."""
        refs = [0] * self.num_blocks
        for blocks in self._req_blocks.values():
            for b in blocks:
                refs[b] += 1
        for b in range(self.num_blocks):
            if refs[b] != self._ref_count[b]:
                raise EngineError(f"block {b}: ref_count {self._ref_count[b]} != owners {refs[b]}")
            if (refs[b] == 0) != (b in self._free):
                raise EngineError(f"block {b}: ref_count {refs[b]} but free={b in self._free}")
        for h, b in self.cached.items():
            if self._block_hash[b] != h:
                raise EngineError(f"block {b}: cached under {h} but carries {self._block_hash[b]}")
