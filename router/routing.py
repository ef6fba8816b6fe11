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

from collections import OrderedDict
from collections.abc import Mapping, Sequence

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
    """Which decode worker takes a request. Its workers are named (the router's names,
    router/pool.py), in the pool's order: ties go to the earlier one, and round_robin
    goes round them in that order."""

    def __init__(self, policy: str, block_size: int, capacity_blocks: int, names: Sequence[str] = ()) -> None:
        self.policy = policy
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.indexes: dict[str, PrefixIndex] = {name: PrefixIndex(capacity_blocks) for name in names}
        self._next = 0  # round_robin: the position in the pool to try first

    def choose(self, prompt: Sequence[int], loads: Mapping[str, int]) -> tuple[str, int]:
        """(worker, prompt tokens it probably has cached) for this prompt; `loads`: each
        worker that may take it (alive, not draining; at least one) -> its requests in
        flight. Records the choice in kv_aware's history."""
        names = list(self.indexes)
        candidates = [i for i, name in enumerate(names) if name in loads]
        if not candidates:
            raise ValueError("no live worker to choose from")
        if self.policy == "round_robin":
            pick = min(candidates, key=lambda i: (i - self._next) % len(names))  # the next one round
            self._next = pick + 1
            return names[pick], 0
        if self.policy == "least_loaded":
            return names[min(candidates, key=lambda i: loads[names[i]])], 0
        # At most len - 1 tokens can be cached: the last one is always computed.
        hashes = hash_full_blocks(prompt[:-1], self.block_size)
        cached = {i: self.indexes[names[i]].cached_blocks(hashes) * self.block_size for i in candidates}
        best = min(candidates, key=lambda i: (len(prompt) - cached[i] + LOAD_TOKENS * loads[names[i]], i))
        self.indexes[names[best]].add(hashes)
        return names[best], cached[best]

    def add(self, name: str) -> None:
        """A worker joined the pool, after the others."""
        self.indexes[name] = PrefixIndex(self.capacity_blocks)
        self._next = 0

    def remove(self, name: str) -> None:
        """The worker left the pool."""
        del self.indexes[name]
        self._next = 0

    def forget(self, name: str) -> None:
        """The worker restarted (its prefix cache is empty), or its events were lost."""
        self.indexes[name] = PrefixIndex(self.indexes[name].capacity)

    def kv_events(self, name: str, events: Sequence[Sequence], reset: bool) -> None:
        """Prefix-cache events the worker reported (its StatsReply.kv_events)."""
        if name not in self.indexes:  # it left the pool meanwhile
            return
        if reset:
            self.forget(name)
        self.indexes[name].apply(events)
