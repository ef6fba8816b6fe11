"""The scheduler's requests whose prefix is being loaded back from the offload tiers.

A waiting request whose prefix continues past the device pool's hits in a tier
(KVCacheManager.get_tier_hits) takes blocks for its whole prompt, as a remote prefill's
reservation does, and leaves the waiting queue while the tier's I/O thread copies those
blocks in (status LOADING_KV); the batch runs on meanwhile. Once the load is done it
joins `ready` with the loaded tokens computed, and they count as cached. A load that
fails (a checksum that does not match, a disk error) costs only time: the request lets
go of its blocks and waits again, and its admission computes what it cannot find.

Why the whole prompt: a loaded request then needs no block for its prompt, which is what
the scheduler's progress argument asks of everything in `ready`. When that many blocks
are not free the request is admitted as if the tiers had nothing (it computes).

A request that ends while its load runs gives its id up at once; its blocks are freed
when the load is done (the I/O thread is writing them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.kv_cache.block_pool import KVBlock
from engine.kv_cache.tiers import KVTiers
from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


class TierLoads:
    """tiers None (no offload tiers): nothing ever loads; every verb is a no-op."""

    def __init__(self, scheduler: Scheduler, tiers: KVTiers | None) -> None:
        self._scheduler = scheduler
        self.kv = scheduler.kv
        self.tiers = tiers
        self.loading: dict[str, tuple[Request, int]] = {}  # id -> (request, blocks computed once loaded)
        self._ended: dict[str, list[KVBlock]] = {}  # ended while loading: their blocks, freed once it is done

    @property
    def busy(self) -> bool:
        """A load is in flight (poll() has something to collect)."""
        return self.tiers is not None and self.tiers.loads_in_flight > 0

    def start(self, request: Request, hits: list[KVBlock]) -> bool:
        """For a waiting request with these device hits (it holds no blocks): load the
        tier blocks that follow them, if any and if its prompt's blocks fit. True: its
        load started (the caller takes it off the waiting queue)."""
        kv = self.kv
        if self.tiers is None:
            return False
        if request.request_id in self.loading or request.request_id in self._ended:
            return False  # its earlier load's id is still busy
        sources = kv.get_tier_hits(request, len(hits))
        if not sources:
            return False
        num_new = request.num_tokens - len(hits) * kv.block_size
        if kv.num_blocks_needed(request, num_new, hits) > kv.num_free_blocks:
            return False
        self.tiers.pin(sources)
        if not kv.allocate_slots(request, num_new, hits):
            self.tiers.unpin(sources)
            return False
        kv.count_query(request, hits)
        blocks = kv.block_ids(request.request_id)[len(hits):len(hits) + len(sources)]
        self.tiers.load(request.request_id, sources, blocks)
        request.status = RequestStatus.LOADING_KV
        self.loading[request.request_id] = (request, len(hits) + len(sources))
        return True

    def poll(self, timeout: float = 0.0) -> None:
        """Move every request whose load is done to `ready` (or, failed, back to waiting);
        waits up to `timeout` for a finished job when none is."""
        if self.tiers is None:
            return
        for result in self.tiers.poll(timeout):
            ended = self._ended.pop(result.request_id, None)
            if ended is not None:
                self.kv.free_blocks(ended)
                continue
            request, num_blocks = self.loading.pop(result.request_id)
            if result.error is not None:
                self.kv.free(request)
                request.status = RequestStatus.WAITING
                self._scheduler.push_waiting(request)
                continue
            request.num_computed_tokens = num_blocks * self.kv.block_size
            if request.num_preemptions == 0:
                request.num_cached_tokens = request.num_computed_tokens
            self.kv.cache_computed_blocks(request)
            self._scheduler.remote.push_ready(request)

    def discard(self, request: Request) -> bool:
        """Take an ending request out; False: it is not loading."""
        if self.loading.pop(request.request_id, None) is None:
            return False
        self._ended[request.request_id] = self.kv.detach(request)
        return True
