"""Routing policies: which decode worker takes a request, and how much of its prompt
that worker probably has cached already.

`kv_aware` keeps, per worker, an index of the block hashes it probably holds (the same
chained hashes the engines' prefix caches use, engine/kv_cache/block_hash.py), most
recent last and bounded by the worker's pool size, and picks the worker with the
lowest cost = prompt tokens it would have to prefill + LOAD_TOKENS per request it is
already serving (in the spirit of Dynamo's KV router). The index learns from two
sources: routing history (a prompt's blocks are added when it is sent, so the next
request sees them at once) and the worker's own prefix-cache events (blocks cached and
evicted, tier by tier, reported with every stats reply, protocol/worker.py StatsReply),
which correct it: an evicted block stops attracting requests. A block a worker holds
only in a KV offload tier (host memory, disk: engine/kv_cache/tiers.py) counts too, at
a discount (TIER_COST: a load back costs more than a device hit, far less than a
prefill), as Dynamo's and llm-d's routers weigh tiers; so does a block in the
deployment's shared KV store (kv_store/), which every worker reports alike (the changes
to its copy of the store's directory). The same overlap, every tier counted as cached,
decides conditional disaggregation: only the uncached part counts toward the threshold.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

from engine.kv_cache.block_hash import NONE_HASH, hash_full_blocks
from engine.kv_cache.events import DEVICE

LOAD_TOKENS = 64  # what one in-flight request costs, in prompt tokens to prefill
# What a cached token costs by the tier it is in (device, host, disk, shared store), in
# prompt tokens to prefill: a device hit is free, a load back from host memory cheap,
# from disk dearer, from the deployment's shared store (a network fetch) dearer still.
TIER_COST = (0.0, 0.1, 0.25, 0.4)
# What sending a LoRA request to a worker that holds no read of its adapter costs, in
# prompt tokens to prefill: the worker reads it from disk first (tens of ms: docs/benchmarks).
LORA_LOAD_TOKENS = 128


class PrefixIndex:
    """The block hashes one worker probably holds: on its device (routing history and
    its device events, LRU-bounded by its pool) or only in its offload tiers (their
    events alone: the worker says when they go)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()  # on the device
        self._tiers: dict[int, int] = {}  # hash -> bit mask of the offload tiers holding it

    def cached_tiers(self, hashes: Sequence[int]) -> list[int]:
        """The nearest tier holding each leading block of a prompt (chained: stop at a
        miss); DEVICE, HOST, DISK or SHARED (engine/kv_cache/events.py)."""
        out = []
        for h in hashes:
            if h in self._hashes:
                out.append(DEVICE)
                continue
            mask = self._tiers.get(h, 0)
            if not mask:
                break
            out.append((mask & -mask).bit_length() - 1)  # the lowest bit: the nearest tier
        return out

    def cached_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of a prompt this worker probably holds, in any tier."""
        return len(self.cached_tiers(hashes))

    def add(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def apply(self, events: Sequence[Sequence]) -> None:
        """The worker's prefix-cache events, in order: (hash, tier, stored?)."""
        for h, tier, stored in events:
            if tier == DEVICE:
                if stored:
                    self.add((h,))
                else:
                    self._hashes.pop(h, None)
                continue
            mask = self._tiers.get(h, 0) | (1 << tier) if stored else self._tiers.get(h, 0) & ~(1 << tier)
            if mask:
                self._tiers[h] = mask
            else:
                self._tiers.pop(h, None)


class Ranking(NamedTuple):
    """A prompt's candidates, the policy's choice first, each with its tokens probably
    cached there; and, for kv_aware, the prompt's block hashes, computed once for the
    ranking and for recording the pick."""

    workers: list[tuple[str, int]]
    hashes: Sequence[int] = ()


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
        ranking = self.rank(prompt, loads)
        name, cached = ranking.workers[0]
        self.picked(name, ranking)
        return name, cached

    def rank(self, prompt: Sequence[int], loads: Mapping[str, int], root: int = NONE_HASH,
             holders: Collection[str] | None = None) -> Ranking:
        """Every worker that may take the prompt, the policy's choice first, each with
        the prompt tokens it probably has cached (0 unless kv_aware); records nothing
        (picked() does, for the one taken). SLO-aware admission (router/admission.py)
        weighs them in this order. A LoRA request's prompt: its blocks' hashes chain
        from `root` (its adapter's), and `holders` are the workers holding the adapter
        read: kv_aware charges the others LORA_LOAD_TOKENS, least_loaded prefers
        holders among equally loaded workers (round_robin goes round regardless)."""
        names = list(self.indexes)
        candidates = [i for i, name in enumerate(names) if name in loads]
        if not candidates:
            raise ValueError("no live worker to choose from")

        def missing(i: int) -> int:  # 1: the worker would read the adapter first
            return int(holders is not None and names[i] not in holders)

        if self.policy == "round_robin":  # the next one round first
            return Ranking([(names[i], 0) for i in sorted(candidates, key=lambda i: (i - self._next) % len(names))])
        if self.policy == "least_loaded":
            return Ranking([(names[i], 0) for i in sorted(candidates, key=lambda i: (loads[names[i]], missing(i), i))])
        # At most len - 1 tokens can be cached: the last one is always computed.
        hashes = hash_full_blocks(prompt[:-1], self.block_size, root=root)
        tiers = {i: self.indexes[names[i]].cached_tiers(hashes) for i in candidates}

        def cost(i: int) -> tuple[float, int]:
            saved = sum(1 - TIER_COST[t] for t in tiers[i]) * self.block_size
            return len(prompt) - saved + LOAD_TOKENS * loads[names[i]] + LORA_LOAD_TOKENS * missing(i), i

        return Ranking([(names[i], len(tiers[i]) * self.block_size) for i in sorted(candidates, key=cost)], hashes)

    def picked(self, name: str, ranking: Ranking) -> None:
        """The prompt `ranking` ranked went to `name`: round_robin moves past it,
        kv_aware remembers its blocks there."""
        if self.policy == "round_robin":
            self._next = list(self.indexes).index(name) + 1
        elif self.policy == "kv_aware":
            self.indexes[name].add(ranking.hashes)

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
