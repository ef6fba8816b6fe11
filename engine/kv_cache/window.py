"""What a sliding window means for a request's KV blocks (the KVCacheManager's part of
it): blocks wholly before the window of a request's next token are never read again,
so they are released as it advances, their places kept in its block list; prefix hits
before the window keep only their places; and a step takes at most chunk_limit() of a
request's tokens, so one longer than the pool still runs alone."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from engine.errors import DoesNotFit
from engine.kv_cache.block_pool import BlockPool, KVBlock
from engine.kv_cache.block_table import BlockTable
from engine.kv_cache.events import DEVICE
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Stands in a request's block list for a block it let go of because it fell out of the
# sliding window (release_out_of_window): its position is kept, so block i still holds
# tokens [i * bs, (i + 1) * bs). Never in the pool; its id (-1) names no block, and the
# step's block table has 0 there (padding), which no attention backend reads.
RELEASED = KVBlock(-1)


def held(blocks: Sequence[KVBlock]) -> list[KVBlock]:
    """The blocks of a request's list that it holds (those not released)."""
    return [b for b in blocks if b is not RELEASED]


def layer_first_blocks(layer_windows: Sequence[int], position: int, block_size: int) -> tuple[int, ...]:
    """Per layer, the first block a query at `position`, or any later one, reads: 0 for
    a layer that attends over every position, past the blocks before its window for
    one with a sliding window. () when no layer has a window."""
    return tuple(max(0, position - w + 1) // block_size if w > 0 else 0 for w in layer_windows)


def reads(first_blocks: Sequence[int], layer: int, block: int) -> bool:
    """Whether `layer` reads `block` (first_blocks: layer_first_blocks')."""
    return first_blocks[layer] <= block


def layer_masks(first_blocks: Sequence[int], lo: int, hi: int) -> list[int]:
    """For each of blocks [lo, hi), a bit per layer that reads it: what a decode worker
    awaits of each block a remote prefill writes (layers_reading's runs, as bits)."""
    return [sum(1 << layer for layer in range(len(first_blocks)) if reads(first_blocks, layer, i))
            for i in range(lo, hi)]


def layers_reading(first_blocks: Sequence[int], lo: int, hi: int,
                   layers: tuple[int, int]) -> list[tuple[int, int, tuple[int, int]]]:
    """Blocks [lo, hi) split where the layers reading them change: (start, end, layer
    range) for each part and each run of consecutive layers within `layers` that read
    it (layer l reads block i when first_blocks[l] <= i; () : every layer, every
    block). What a prefill worker writes of a mixed local/global model: blocks before
    the local layers' window carry the global layers only."""
    l0, l1 = layers
    if not first_blocks:
        return [(lo, hi, layers)] if lo < hi else []
    cuts = sorted({lo, hi, *(f for f in first_blocks[l0:l1] if lo < f < hi)})
    parts = []
    for start, end in zip(cuts, cuts[1:]):
        run_start = None
        for layer in range(l0, l1 + 1):
            reading = layer < l1 and reads(first_blocks, layer, start)
            if reading and run_start is None:
                run_start = layer
            elif not reading and run_start is not None:
                parts.append((start, end, (run_start, layer)))
                run_start = None
    return parts


class WindowBlocks:
    """KVCacheManager's sliding-window methods; the state is the manager's."""

    block_size: int
    sliding_window: int  # every layer's widest window; 0: some layer reads every block
    pool: BlockPool
    req_blocks: dict[str, list[KVBlock]]
    block_table: BlockTable
    _released: dict[str, int]  # per request: how many of its first blocks it released
    # Per request: its blocks before this index hold only some layers' KV (a remote
    # prefill wrote each block only the layers that read it): never cached.
    _partial: dict[str, int]
    layer_windows: tuple[int, ...]  # the model's, per layer (0: full attention); ()

    def _update_hashes(self, request: Request) -> None:
        raise NotImplementedError

    def num_released(self, request_id: str) -> int:
        """How many of the request's first blocks it released (out of its sliding window)."""
        return self._released.get(request_id, 0)

    def _hits_out_of_window(self, hits: Sequence[KVBlock]) -> int:
        """How many of a request's first prefix hits lie wholly before the window of its
        first new token: their places are kept (RELEASED), the blocks not taken."""
        return min(self.window_first_block(len(hits) * self.block_size), len(hits)) if hits else 0

    def check_room(self, num_prompt_tokens: int, max_tokens: int, whole_prompt: bool = False) -> None:
        """DoesNotFit, naming what to change, for a request the pool could not run even
        alone. It needs its prompt's and first output token's blocks, then all its
        tokens'. With a sliding window it runs chunk by chunk (chunk_limit) holding the
        window's span and 5 more blocks (the block it grows into, a step's chunk, and
        the chunk of a step in flight, whose blocks are released a step later), unless
        it holds its whole prompt (`whole_prompt`: a prefill worker's, for its push)."""
        pool, prompt = self.pool.num_blocks, cdiv(num_prompt_tokens + 1, self.block_size)
        needed = cdiv(num_prompt_tokens + max_tokens, self.block_size)
        if self.sliding_window:
            window = cdiv(self.sliding_window, self.block_size) + 5
            if not whole_prompt and prompt > window:
                if window > pool:
                    raise DoesNotFit(f"the KV pool's {pool} blocks cannot hold the sliding window of "
                                     f"{self.sliding_window} tokens and a step's chunk beside it ({window} blocks); "
                                     "enlarge the pool", "prompt")
                prompt = window
            needed = min(needed, max(prompt, window))
        if prompt > pool:
            raise DoesNotFit(f"prompt ({num_prompt_tokens} tokens) needs more than the KV pool's {pool} blocks "
                             "with its first output token; shorten the prompt or enlarge the pool", "prompt")
        if needed > pool:
            raise DoesNotFit(f"request needs {needed} KV blocks (prompt {num_prompt_tokens} + max_tokens "
                             f"{max_tokens}) but the KV pool has only {pool}; lower max_tokens or enlarge the pool",
                             "max_tokens")

    def chunk_limit(self) -> int:
        """The most tokens one step may compute for one request. With a sliding window,
        a request longer than the pool (a recompute after preemption: prompt and
        outputs) still runs alone, chunk by chunk: its window's span, this step's chunk
        and the last step's (released only once that step's update runs) fit the pool.
        Without one, any number."""
        if not self.sliding_window:
            return sys.maxsize
        room = (self.pool.num_blocks - 3) * self.block_size - self.sliding_window
        return max(self.block_size, room // 2)

    def window_first_block(self, position: int) -> int:
        """The first block a query at `position`, or any later one, reads (0 without a
        sliding window)."""
        if not self.sliding_window:
            return 0
        return max(0, position - self.sliding_window + 1) // self.block_size

    def write_by_layer(self, request: Request, first: int) -> tuple[int, ...]:
        """A decode worker's reservation of a prompt whose blocks [first, ...) a prefill
        worker writes: per layer, the first of them it writes that layer in, the first
        the layer reads from the prompt's last token on (a mixed local/global model's
        local layers never read the blocks before their window; the global ones read
        every block). Those blocks then hold some layers' KV only, so they are never
        cached here, and the router hears they are not. () : every layer of every block.
        Each is at least `first`; the blocks before the smallest no layer reads (a
        windowed model whose draft's wider window keeps them held) are not written."""
        firsts = layer_first_blocks(self.layer_windows, request.num_prompt_tokens - 1, self.block_size)
        whole_from = max(firsts, default=0)
        if whole_from <= first:
            return ()
        self._partial[request.request_id] = whole_from
        self._not_held(request, list(range(first, whole_from)))
        return tuple(max(f, first) for f in firsts)

    def release_before(self, request: Request, first: int) -> int:
        """Let go of the request's blocks before block `first` (that no step will read:
        they are out of its sliding window). Returns the blocks released."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        done = self._released.get(rid, 0)
        if not blocks or first <= done:
            return 0
        first = min(first, len(blocks))
        dead = held(blocks[done:first])
        unwritten = [i for i in range(done, first) if blocks[i] is not RELEASED and blocks[i].block_hash is None]
        for i in range(done, first):
            blocks[i] = RELEASED
            self.block_table.set(rid, i, 0)
        self._released[rid] = first
        self.pool.free(reversed(dead))
        self._not_held(request, unwritten)
        return len(dead)

    def _not_held(self, request: Request, places: list[int]) -> None:
        """Tell the collector of prefix-cache events (the router's kv_aware index) that
        these of the request's blocks, released before their KV was ever written (a
        remote prefill's, out of the window), are not held here: the router counts a
        prompt's blocks as a worker's when it sends it there."""
        events = self.pool.events
        if events is None or not places:
            return
        self._update_hashes(request)
        for i in places:
            if i < len(request.block_hashes) and not self.pool.is_cached(request.block_hashes[i]):
                events.record(request.block_hashes[i], DEVICE, False)
