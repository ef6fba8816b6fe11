"""Maps requests to KV blocks: prefix-cache lookup, slot allocation, caching, freeing."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.errors import EngineStateError
from engine.kv_cache.block_hash import hash_full_blocks
from engine.kv_cache.block_pool import BlockPool, KVBlock
from engine.kv_cache.block_table import BlockTable
from engine.kv_cache.tier_store import TierEntry
from engine.kv_cache.tiers import KVTiers
from engine.kv_cache.window import RELEASED, WindowBlocks, cdiv, held
from engine.request import Request


class KVCacheManager(WindowBlocks):
    """Called by the scheduler only. Owns one reference on every block a request holds."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int = 0, layer_windows: Sequence[int] = ()) -> None:
        """sliding_window > 0: every layer of every model reading these blocks attends
        over at most that many positions, so blocks wholly before a request's window are
        released as it advances (release_out_of_window). layer_windows: the model's
        window per layer (0: full attention), for what a remote prefill writes of each
        block (write_by_layer)."""
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0 (0: none), got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        # Per request: how many of its first blocks it has released (RELEASED in its list).
        self._released: dict[str, int] = {}
        self.layer_windows = tuple(layer_windows)
        self._partial: dict[str, int] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.block_table = BlockTable()  # the same block ids as numpy rows, for the runner
        # Per request: how many of its blocks are already registered in the cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Parallel sampling (fork): per forked request, the index of the partial last
        # block it shares with its siblings, copied on its first write (copy-on-write).
        self._shared_tail: dict[str, int] = {}
        # (source, destination) block ids to copy before the next step's forward: the
        # engine core takes them (take_copies) and the runner copies on every rank.
        self._copies: list[tuple[int, int]] = []
        # Blocks a remote KV write may still land in (a decode worker's reservations
        # in flight, and dead ones until their sender confirms): no step may read them.
        # Per block a count, as two fences may name one block.
        self._fences = np.zeros(num_blocks, dtype=np.int32)
        self.num_fenced = 0  # blocks with a fence
        self.tiers: KVTiers | None = None  # the offload tiers below the pool (attach_tiers)

    def attach_tiers(self, tiers: KVTiers) -> None:
        """Offload cached blocks to `tiers` as the pool reuses them; look prefixes up there
        after the pool (get_tier_hits). With a shared store attached to the tiers, every
        block goes to them as soon as it is cached too (written through): a prefix one
        worker computed is then in the store while it is still hot in that worker's
        pool, which is when other workers want it; its eviction later copies nothing."""
        if not self.enable_prefix_caching:
            raise ValueError("the KV offload tiers need enable_prefix_caching: they keep blocks by prefix hash")
        self.tiers = tiers
        self.pool.on_evict = tiers.offload
        if tiers.shared is not None:
            self.pool.on_cache = tiers.offload

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_held_blocks(self, request_id: str) -> int:
        return len(self.req_blocks.get(request_id, ())) - self._released.get(request_id, 0)

    def block_ids(self, request_id: str) -> list[int]:
        """Its blocks in order; -1 for each released out of its sliding window."""
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def block_tables(self, request_ids: list[str]) -> np.ndarray:
        """[len(request_ids), max blocks held] int32 block ids, rows padded with 0.
        Raises EngineStateError if any request holds a fenced block: a step must never
        read KV that a remote write may still overwrite."""
        table = self.block_table.gather(request_ids)
        if self.num_fenced and len(request_ids):
            # Only the blocks each holds: not the padding, nor the 0s where it released some.
            first = np.array([self._released.get(r, 0) for r in request_ids])
            end = np.array([len(self.req_blocks.get(r, ())) for r in request_ids])
            column = np.arange(table.shape[1])[None, :]
            hit = (self._fences[table] > 0) & (column >= first[:, None]) & (column < end[:, None])
            if hit.any():
                rows = np.nonzero(hit.any(axis=1))[0]
                raise EngineStateError(f"requests {[request_ids[i] for i in rows[:4]]} hold fenced blocks "
                                       f"{sorted(set(table[hit].tolist()))[:8]}: a remote write may still land there")
        return table

    def fence(self, block_ids: list[int]) -> None:
        """A remote write may land in these blocks: no step reads them until unfence()."""
        for b in block_ids:
            self.num_fenced += int(self._fences[b] == 0)
            self._fences[b] += 1

    def unfence(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if self._fences[b] <= 0:
                raise EngineStateError(f"block {b} unfenced more often than fenced")
            self._fences[b] -= 1
            self.num_fenced -= int(self._fences[b] == 0)

    def _update_hashes(self, request: Request) -> None:
        request.block_hashes = hash_full_blocks(request.all_token_ids, self.block_size,
                                                request.block_hashes, request.hash_root)

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """Longest cached prefix of the request's tokens, as blocks (no refs taken).

        At most num_tokens - 1 tokens count as computed: the last token is always run
        through the model so there are logits to sample from. Counts nothing in the
        cache statistics: the caller that admits the request with these hits does
        (count_query), so a probe, or an admission that does not fit, is no query.
        """
        if not self.enable_prefix_caching:
            return []
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        parent = request.hash_root
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            start = i * self.block_size
            block = self.pool.lookup(parent, block_hash,
                                     request.all_token_ids[start:start + self.block_size])
            if block is None:
                break
            hits.append(block)
            parent = block_hash
        return hits

    def get_tier_hits(self, request: Request, num_hits: int) -> list[tuple[str, TierEntry]]:
        """The offload tiers' blocks continuing the request's prefix after its first
        `num_hits` blocks (get_computed_blocks' hits), within the same limit: (tier name,
        entry) each. [] without tiers."""
        if self.tiers is None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes, tokens, bs = request.block_hashes, request.all_token_ids, self.block_size
        blocks = ((hashes[i], tokens[i * bs:(i + 1) * bs]) for i in range(num_hits, max_blocks))
        return self.tiers.lookup(hashes[num_hits - 1] if num_hits else request.hash_root, blocks)

    def count_query(self, request: Request, hits: list[KVBlock]) -> None:
        """Count the request's prefix-cache lookup that found `hits` in the pool's
        statistics: once per admission that takes them, as vLLM counts a request's
        query when it is scheduled. The blocks looked up: each hit, and the first miss
        unless the hits reach get_computed_blocks' limit."""
        if not self.enable_prefix_caching:
            return
        max_blocks = (request.num_tokens - 1) // self.block_size
        self.pool.num_cache_queries += min(len(hits) + 1, max_blocks)
        self.pool.num_cache_hits += len(hits)

    def num_blocks_needed(self, request: Request, num_new_tokens: int,
                          new_computed_blocks: Sequence[KVBlock] = ()) -> int:
        """Blocks that allocate_slots would take off the free queue."""
        held = len(self.req_blocks.get(request.request_id, ())) + len(new_computed_blocks)
        total = cdiv(request.num_started_tokens + len(new_computed_blocks) * self.block_size
                     + num_new_tokens, self.block_size)
        # Reviving a free cached hit also consumes a free-queue entry (not one taken
        # only for its place: out of the window).
        skip = self._hits_out_of_window(new_computed_blocks)
        revived = sum(1 for b in new_computed_blocks[skip:] if b.ref_cnt == 0)
        return max(0, total - held) + revived

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVBlock] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens; False if they don't fit.

        On success the request holds the computed (prefix-hit) blocks followed by enough
        fresh blocks; on failure nothing changes.
        """
        blocks = self.req_blocks.get(request.request_id)
        if self._shared_tail and request.request_id in self._shared_tail:
            return self._allocate_unshared(request, num_new_tokens)
        if new_computed_blocks and (blocks or request.num_started_tokens):
            # Its own blocks' KV would be shadowed, or tokens counted twice.
            raise EngineStateError(f"request {request.request_id!r} holds {len(blocks or ())} blocks and "
                                   f"{request.num_started_tokens} computed tokens; prefix hits only "
                                   "apply to a request holding neither")
        if (blocks and not new_computed_blocks
                and request.num_started_tokens + num_new_tokens <= len(blocks) * self.block_size):
            return True  # most decode steps: the new token's slot is in a block already held
        if self.num_blocks_needed(request, num_new_tokens, new_computed_blocks) > self.num_free_blocks:
            return False
        blocks = self.req_blocks.setdefault(request.request_id, [])
        held = len(blocks)
        if new_computed_blocks:
            skip = self._hits_out_of_window(new_computed_blocks)
            self.pool.touch(new_computed_blocks[skip:])
            blocks.extend([RELEASED] * skip + list(new_computed_blocks[skip:]))
            self._num_cached_blocks[request.request_id] = len(new_computed_blocks)
            if skip:
                self._released[request.request_id] = skip
        total = cdiv(request.num_started_tokens + len(new_computed_blocks) * self.block_size
                     + num_new_tokens, self.block_size)
        if total > len(blocks):
            blocks.extend(self.pool.allocate(total - len(blocks)))
        if len(blocks) > held:
            self.block_table.append(request.request_id, [max(b.block_id, 0) for b in blocks[held:]])
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's blocks holding its computed tokens (one more
        reference each; the child holds no blocks yet). A partial last block is shared
        until the child's first write into it, which copies it (allocate_slots)."""
        if self.req_blocks.get(child.request_id):
            raise EngineStateError(f"request {child.request_id!r} already holds blocks; it cannot be forked into")
        num_computed = parent.num_computed_tokens
        blocks = self.req_blocks.get(parent.request_id, [])[:cdiv(num_computed, self.block_size)]
        if not blocks:
            return
        self.pool.touch(held(blocks))
        self.req_blocks[child.request_id] = list(blocks)
        self.block_table.append(child.request_id, [max(b.block_id, 0) for b in blocks])
        if self._released.get(parent.request_id):
            self._released[child.request_id] = self._released[parent.request_id]
        if parent.request_id in self._num_cached_blocks:
            self._num_cached_blocks[child.request_id] = self._num_cached_blocks[parent.request_id]
        if num_computed % self.block_size:
            self._shared_tail[child.request_id] = len(blocks) - 1

    def _allocate_unshared(self, request: Request, num_new_tokens: int) -> bool:
        """allocate_slots for a forked request before its first write: its shared last
        block becomes its own first (a copy, unless no sibling holds it any more)."""
        rid = request.request_id
        blocks, index = self.req_blocks[rid], self._shared_tail[rid]
        tail = blocks[index]
        copy = tail.ref_cnt > 1
        if copy and self.num_blocks_needed(request, num_new_tokens) + 1 > self.num_free_blocks:
            return False
        del self._shared_tail[rid]
        if copy:
            own = self.pool.allocate(1)[0]
            self._copies.append((tail.block_id, own.block_id))
            self.pool.free([tail])
            blocks[index] = own
            self.block_table.set(rid, index, own.block_id)
        if self.allocate_slots(request, num_new_tokens):
            return True
        raise EngineStateError(f"request {rid!r}: blocks counted free for its first write were not")

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies (source, destination) the next step must make before it
        writes; each is taken once."""
        copies, self._copies = self._copies, []
        return copies

    def cache_computed_blocks(self, request: Request, copied_in: bool = False) -> None:
        """Register every full block whose KV is now written (called after each step).
        `copied_in`: that KV came from elsewhere (a remote prefill), which keeps its own
        copy: not written through to the tiers, only offloaded if evicted."""
        if not self.enable_prefix_caching:
            return
        start = self._num_cached_blocks.get(request.request_id, 0)
        if request.num_computed_tokens < (start + 1) * self.block_size:
            return  # no block filled since the last call: most steps of most requests
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        if num_full <= start:
            return
        self._update_hashes(request)
        partial = self._partial.get(request.request_id, 0)
        for i in range(start, num_full):
            if blocks[i] is RELEASED or i < partial:  # let go of before it was cached, or some layers only
                continue
            parent = request.block_hashes[i - 1] if i else request.hash_root
            tokens = request.all_token_ids[i * self.block_size:(i + 1) * self.block_size]
            self.pool.cache(blocks[i], parent, request.block_hashes[i], tokens, write_through=not copied_in)
        self._num_cached_blocks[request.request_id] = num_full

    def release_out_of_window(self, request: Request) -> int:
        """With a sliding window, let go of the request's blocks wholly before the window
        of its next token (the first position any later step reads), after caching them
        (cache_computed_blocks first: the prefix cache keeps them while they stay free).
        Call once a step's tokens are computed, never while a step that started earlier
        may still read them. Returns the blocks released."""
        return self.release_before(request, self.window_first_block(request.num_computed_tokens))

    def free(self, request: Request) -> None:
        """Release all of the request's blocks, tail first (see BlockPool.free)."""
        self.free_blocks(self.detach(request))

    def detach(self, request: Request) -> list[KVBlock]:
        """Take the request's blocks off its id without freeing them (free_blocks later):
        its id may be reused at once while a queued step still writes those blocks."""
        blocks = held(self.req_blocks.pop(request.request_id, []))
        self._released.pop(request.request_id, None)
        self._partial.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self._shared_tail.pop(request.request_id, None)
        self.block_table.remove(request.request_id)
        return blocks

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        self.pool.free(reversed(blocks))

    def hold(self, request_id: str, first: int, end: int) -> list[KVBlock]:
        """One more reference on the request's blocks [first, end), for a reader outside
        the engine's steps (a KV write still reading them): they are not reused, even
        once the request lets go of them (preempted, aborted), until free_blocks(them)."""
        blocks = self.req_blocks[request_id][first:end]
        if len(blocks) != end - first:
            raise ValueError(f"request {request_id!r} holds {len(self.req_blocks[request_id])} blocks, "
                             f"not [{first}, {end})")
        if first < self._released.get(request_id, 0):
            raise ValueError(f"request {request_id!r} released its first {self._released[request_id]} blocks "
                             f"(out of its sliding window): it cannot hold [{first}, {end})")
        self.pool.touch(blocks)
        return blocks

    def invalidate(self, block_ids: list[int]) -> list[str]:
        """These blocks' contents are unknown: they leave the prefix cache. Returns the
        requests holding any of them."""
        ids = set(block_ids)
        hashes = [h for h in (self.pool.blocks[i].block_hash for i in ids) if h is not None]
        for block_id in ids:
            self.pool.uncache(self.pool.blocks[block_id])
        if self.tiers is not None:  # a copy may have reached them (evicted, or written through)
            self.tiers.revoke(hashes)
        return [rid for rid, blocks in self.req_blocks.items() if any(b.block_id in ids for b in blocks)]

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.pool.num_blocks
