"""Routing policies: which decode worker takes a request, and how much of its prompt
that worker probably has cached already.

`kv_aware` keeps, per worker, an index of the block hashes it probably holds (the same
chained hashes the engines' prefix caches use, engine/kv_cache/block_hash.py), most
recent last and bounded by the worker's pool size, and picks the worker with the
lowest cost = prompt tokens it would have to prefill + LOAD_TOKENS per request it is
already serving (in the spirit of Dynamo's KV router). The index learns from two
sources: routing history (a prompt's blocks are added when it is sent, so the next
request sees them at once) and the worker's own prefix-cache events (blocks cached and
evicted, reported with every stats reply, protocol/worker.py StatsReply), which correct it: an
evicted block stops attracting requests. The same overlap decides conditional
disaggregation: only the uncached part counts toward the threshold.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from engine.kv_cache.block_hash import hash_full_blocks

LOAD_TOKENS = 64  # what one in-flight request costs, in prompt tokens to prefill


class PrefixIndex:
    """The block hashes one worker was last sent (routing history), LRU-bounded."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def cached_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of a prompt this worker probably holds (chained: stop at a miss)."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def add(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def apply(self, events: Sequence[Sequence]) -> None:
        """The worker's prefix-cache events, in order: [hash, True] cached, [hash, False]
        evicted."""
        for h, cached in events:
            if cached:
                self.add((h,))
            else:
                self._hashes.pop(h, None)


class RoutingPolicy:
    def __init__(self, policy: str, num_workers: int, block_size: int, capacity_blocks: int) -> None:
        self.policy = policy
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.indexes = [PrefixIndex(capacity_blocks) for _ in range(num_workers)]
        self._round_robin = itertools.cycle(range(num_workers))

    def choose(self, prompt: Sequence[int], loads: Sequence[int],
               live: Sequence[bool] | None = None) -> tuple[int, int]:
        """(worker index, prompt tokens it probably has cached) for this prompt, given
        each worker's requests in flight and which workers are alive (all if None; at
        least one must be). Records the choice in kv_aware's history."""
        candidates = [i for i in range(len(loads)) if live is None or live[i]]
        if not candidates:
            raise ValueError("no live worker to choose from")
        if self.policy == "round_robin":
            # At most one lap: some worker in the cycle is alive.
            return next(i for i in self._round_robin if i in candidates), 0
        if self.policy == "least_loaded":
            return min(candidates, key=lambda i: loads[i]), 0
        # At most len - 1 tokens can be cached: the last one is always computed.
        hashes = hash_full_blocks(prompt[:-1], self.block_size)
        cached = [idx.cached_blocks(hashes) * self.block_size for idx in self.indexes]
        best = min(candidates, key=lambda i: (len(prompt) - cached[i] + LOAD_TOKENS * loads[i], i))
        self.indexes[best].add(hashes)
        return best, cached[best]

    def add(self) -> None:
        """A worker joined the pool, after the others (its index: their number)."""
        self.indexes.append(PrefixIndex(self.capacity_blocks))
        self._round_robin = itertools.cycle(range(len(self.indexes)))

    def remove(self, index: int) -> None:
        """Worker `index` left the pool; those after it move down one."""
        self.indexes.pop(index)
        self._round_robin = itertools.cycle(range(len(self.indexes)))

    def forget(self, index: int) -> None:
        """Worker `index` restarted (its prefix cache is empty), or its events were lost."""
        self.indexes[index] = PrefixIndex(self.indexes[index].capacity)

    def kv_events(self, index: int, events: Sequence[Sequence], reset: bool) -> None:
        """Prefix-cache events reported by worker `index` (their StatsReply.kv_events)."""
        if reset:
            self.forget(index)
        self.indexes[index].apply(events)
