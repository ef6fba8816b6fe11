"""Fixed-size KV blocks: reference counts, an LRU free queue, and the prefix-cache map.

Pure Python bookkeeping; the tensor memory lives in the model runner. A block is in
exactly one of three states:

    in use      ref_cnt > 0, not in the free queue
    free+cached ref_cnt == 0, in the free queue, still findable by its hash
    free        ref_cnt == 0, in the free queue, no hash

The free queue is also the eviction order: allocation takes the least recently freed
block and, if it was cached, drops its hash first. So a cached block survives until
every uncached and older cached block has been reused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from engine.errors import EngineStateError
from engine.kv_cache.events import DEVICE, KVEvents


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and its KV is written; (parent_hash, token_ids) let a
    # lookup confirm a hit instead of trusting a 64-bit hash alone.
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, KVBlock] = {}  # block hash -> block
        # Prefix-cache statistics, counted once per admission (KVCacheManager.count_query),
        # never by a lookup itself: a probe of what a request would need is no query.
        self.num_cache_queries = 0  # blocks looked up
        self.num_cache_hits = 0  # blocks found
        # Prefix-cache events (device tier), while someone collects them (a decode
        # worker, for the router's kv_aware index): engine/kv_cache/events.py.
        self.events: KVEvents | None = None
        # Called with each cached block about to be reused, while its KV is still intact
        # (the offload tiers copy it out: engine/kv_cache/tiers.py). Not for blocks whose
        # contents are unknown (uncache) or dropped wholesale (reset_prefix_cache).
        self.on_evict: Callable[[KVBlock], None] | None = None
        # Called with each block as it is cached (its KV written): with a shared KV store,
        # the tiers write it through at once, so other workers find it before this
        # one evicts it.
        self.on_cache: Callable[[KVBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take n blocks off the free queue (evicting cached ones); caller owns one ref each."""
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks, only {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.ref_cnt != 0:
                raise EngineStateError(f"free block {block_id} has ref_cnt {block.ref_cnt}")
            if block.block_hash is not None and self.on_evict is not None:
                self.on_evict(block)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        # Ascending ids: a request's blocks come back tail-first (free), so the next
        # request would get them descending, and a KV push between workers moves a run of
        # consecutive ids on both sides as one descriptor (kv_transfer/runs.py), but a
        # descending one block by block. Which blocks are evicted does not change.
        out.sort(key=lambda block: block.block_id)
        return out

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def lookup(self, parent_hash: int, block_hash: int, token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block holding exactly these tokens after this parent, if any."""
        block = self._cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (prefix-cache hits); revives free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the back of the free queue.

        Callers pass a request's blocks tail-first so its last blocks, the least likely
        to be shared, are evicted before its prefix.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise EngineStateError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache(self, block: KVBlock, parent_hash: int, block_hash: int,
              token_ids: Sequence[int], write_through: bool = True) -> None:
        """Register a full, written block under its hash (first writer wins);
        on_cache is told unless not `write_through`."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already cached; this one stays private
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, tuple(token_ids)
        self._cached[block_hash] = block
        if self.events is not None:
            self.events.record(block_hash, DEVICE, True)
        if self.on_cache is not None and write_through:
            self.on_cache(block)

    def uncache(self, block: KVBlock) -> None:
        """Forget the block's hash: its contents are no longer what the hash says."""
        self._evict(block)

    def reset_prefix_cache(self) -> None:
        for block in list(self._cached.values()):
            self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            if self.events is not None:
                self.events.record(block.block_hash, DEVICE, False)
            block.block_hash = block.parent_hash = block.token_ids = None
