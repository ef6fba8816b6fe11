"""The KV cache hierarchy below the device pool: a host tier, and a disk tier under it.

    offload(block)   BlockPool, as it reuses a free cached block: its bytes are copied to
                     a host slot first (in order before whatever writes the block next),
                     then sealed and written through to the disk tier by the I/O thread.
                     With every host slot busy the block is dropped: a tier is a cache.
    lookup(...)      KVCacheManager, where the device prefix cache's hits end: the blocks
                     that follow, host tier first, then disk, as far as the chain goes.
    pin(...)         the scheduler (engine/tier_loads.py), before it allocates blocks
                     for them (which offloads, and could evict them).
    load(...)        the scheduler: copy those blocks into a
                     request's new blocks on the I/O thread; poll() reports it done, or
                     failed (a checksum that does not match, a disk error): then the
                     request computes them instead and the bad entry is forgotten.

Each tier evicts least recently used first; a hit or a new offload of a block makes it
most recently used. The device pool stays the only place a step reads KV from.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import xxhash

from engine.kv_cache import events
from engine.kv_cache.block_pool import KVBlock
from engine.kv_cache.shared_tier import SharedTier
from engine.kv_cache.tier_io import SHARED, DropJob, LoadJob, SealJob, TierIO
from engine.kv_cache.tier_store import DiskStore, HostStore, SlotIndex, TierEntry

logger = logging.getLogger(__name__)

HOST, DISK = "host", "disk"
# Blocks in staging memory (evicted while every host slot was busy) at most, on their way
# to the disk tier or the shared store: beyond, one is dropped rather than memory growing.
MAX_STAGED = 256


@dataclass(frozen=True)
class TierUsage:
    name: str  # "host", "disk" or "shared"
    capacity_blocks: int
    used_blocks: int
    hits: int  # blocks loaded back from this tier so far


@dataclass(frozen=True)
class OffloadStats:
    """The offload tiers' figures so far (EngineStats.offload)."""

    tiers: tuple[TierUsage, ...]
    offloaded_bytes: int  # copied from the device pool to the host tier
    loaded_bytes: int  # copied back from a tier into the device pool
    loads: int  # requests whose prefix was loaded back
    load_seconds: float  # their loads' time, summed (submit to done)
    failed_loads: int  # a checksum mismatch or an I/O error: the request computed instead
    dropped_blocks: int  # evicted from the device while every host slot was busy


@dataclass(frozen=True)
class LoadResult:
    request_id: str
    error: str | None  # None: every block is in place


class KVTiers:
    def __init__(self, caches: Sequence[torch.Tensor], host_bytes: int, disk_dir: str | None,
                 disk_bytes: int, namespace: str, mirrors: Sequence[torch.Tensor] = ()) -> None:
        """caches: every rank cache this process reaches, rank 0 first; a slot holds a
        block of each. mirrors: rank caches that hold the same bytes as caches[0] (MLA's
        latent, whole on every rank): kept once, and a loaded block copied into each.
        namespace names the configuration (model, dtype, layout, ranks): it seeds the
        checksums, so no other configuration's bytes pass."""
        self.caches = list(caches)
        self.block_bytes = sum(c[0].numel() * c.element_size() for c in self.caches)
        host_slots = host_bytes // self.block_bytes
        if host_slots < 1:
            raise ValueError(f"kv_offload_gib ({host_bytes / 2**30:g}) is too small for one KV block "
                             f"({self.block_bytes} bytes)")
        self._cuda = self.caches[0].device.type == "cuda"
        shapes = [c.shape[1:] for c in self.caches]
        self.host = SlotIndex(HOST, events.HOST, host_slots)
        self._host_store = HostStore(shapes, self.caches[0].dtype, host_slots, pin=self._cuda)
        self.disk: SlotIndex | None = None
        disk_store = None
        if disk_dir is not None:
            disk_slots = disk_bytes // self.block_bytes
            if disk_slots < 1:
                raise ValueError(f"kv_offload_disk_gib ({disk_bytes / 2**30:g}) is too small for one KV "
                                 f"block ({self.block_bytes} bytes)")
            self.disk = SlotIndex(DISK, events.DISK, disk_slots)
            disk_store = DiskStore(disk_dir, shapes, self.caches[0].dtype, disk_slots)
        self._disk_store = disk_store
        self.io = TierIO(self.caches, self._host_store, disk_store, xxhash.xxh3_64_intdigest(namespace.encode()),
                         mirrors)
        self.shared: SharedTier | None = None
        self._shared_hits = 0
        self._last_copy: torch.cuda.Event | None = None  # CUDA: the latest offload's copy
        self._staged = 0  # seals of blocks in staging memory (no host slot) not yet polled
        self.loads_in_flight = 0
        self._offloaded = self._loaded = self._loads = self._failed = self._dropped = 0
        self._load_seconds = 0.0
        self._disk_errors = 0  # disk writes failed (a full disk): logged once per 1,000

    def attach_shared(self, shared: SharedTier) -> None:
        """Put every sealed block to the deployment's KV store too, and look prefixes
        up in it after this worker's own tiers (shared_tier.py); closed with the tiers."""
        shared.open(self.io.seed)
        self.shared = self.io.shared = shared

    def collect_events(self, collected: events.KVEvents) -> None:
        """Record each tier's blocks coming and going in `collected` from now on; the
        shared tier's are the changes to the worker's copy of the store's directory."""
        for index in self.indexes:
            index.events = collected
        if self.shared is not None:
            shared = self.shared
            shared.track_changes()

            def shared_events() -> tuple[list[events.Event], bool]:
                changes, lost = shared.take_changes()
                return [(h, events.SHARED, stored) for h, stored in changes], lost

            collected.more = shared_events

    @property
    def indexes(self) -> list[SlotIndex]:
        return [self.host] if self.disk is None else [self.host, self.disk]

    def offload(self, block: KVBlock) -> None:
        assert block.block_hash is not None and block.parent_hash is not None and block.token_ids is not None
        if self.host.touch(block.block_hash):
            return
        slot = self.host.take_slot()
        if slot is None and self._staged >= MAX_STAGED:
            self._dropped += 1
            return
        disk_entry = None
        if self.disk is not None and not self.disk.touch(block.block_hash):
            disk_slot = self.disk.take_slot()
            if disk_slot is not None:
                disk_entry = TierEntry(block.block_hash, block.parent_hash, block.token_ids, disk_slot, pins=1)
                self.disk.add(disk_entry)
        if slot is None and disk_entry is None and self.shared is None:
            self._dropped += 1
            return
        # Every host slot busy (their seals not yet polled: one admission can evict more
        # blocks than the host tier has): the block goes on to the disk tier and the
        # shared store through staging memory of its own, freed once it is sealed.
        staged = None if slot is not None else [torch.empty_like(p, pin_memory=self._cuda)
                                                for p in self._host_store.pieces(0)]
        targets = self._host_store.pieces(slot) if slot is not None else staged
        assert targets is not None
        for cache, piece in zip(self.caches, targets):
            piece.copy_(cache[block.block_id], non_blocking=self._cuda)
        copied = None
        if self._cuda:
            copied = self._last_copy = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(self.caches[0].device))  # the cache's device, not the current one
        self._staged += staged is not None
        entry = None
        if slot is not None:
            entry = TierEntry(block.block_hash, block.parent_hash, block.token_ids, slot, pins=1)
            self.host.add(entry)
        key = TierEntry(block.block_hash, block.parent_hash, block.token_ids, slot=-1)
        self.io.submit(SealJob(key, entry, disk_entry, copied, staged))
        self._offloaded += self.block_bytes

    def revoke(self, hashes: Sequence[int]) -> None:
        """These blocks' KV was not what their hash says when copied here (a late remote
        write had landed in them): every tier forgets them, the shared store too."""
        for block_hash in hashes:
            for index in self.indexes:
                entry = index.entries.get(block_hash)
                if entry is not None:
                    index.drop(entry)  # a seal in flight still ends; its entry is gone
        if self.shared is not None and hashes:
            self.shared.revoke(hashes)  # at once: a load queued this step must not find them
            self.io.submit(DropJob())

    def settle(self) -> None:
        """Wait until every block offloaded so far is copied out (CUDA: the copies run on
        the step stream): before the blocks they came from may be written by something
        not ordered after that stream, e.g. a remote prefill's KV write."""
        if self._last_copy is not None:
            self._last_copy.synchronize()
            self._last_copy = None

    def lookup(self, parent_hash: int, blocks: Iterable[tuple[int, Sequence[int]]]) -> list[tuple[str, TierEntry]]:
        """The tier entries continuing a chain after `parent_hash`, for `blocks` (block
        hash, token ids) in order, as far as some tier holds each."""
        out: list[tuple[str, TierEntry]] = []
        for block_hash, token_ids in blocks:
            for index in self.indexes:
                entry = index.lookup(parent_hash, block_hash, token_ids)
                if entry is not None:
                    out.append((index.name, entry))
                    break
            else:
                if self.shared is None or not self.shared.holds(block_hash):
                    break
                out.append((SHARED, TierEntry(block_hash, parent_hash, tuple(token_ids), slot=-1)))
            parent_hash = block_hash
        return out

    def pin(self, sources: list[tuple[str, TierEntry]]) -> None:
        """Keep these entries' slots from reuse (until load() is done with them, or
        unpin): before the blocks to load them into are allocated, as that evicts to
        the tiers."""
        for _, entry in sources:
            entry.pins += 1

    def unpin(self, sources: list[tuple[str, TierEntry]]) -> None:
        for tier, entry in sources:
            if tier != SHARED:  # a shared source holds no slot of ours
                self._index(tier).unpin(entry)

    def load(self, request_id: str, sources: list[tuple[str, TierEntry]], block_ids: list[int]) -> None:
        """Copy `sources` (pinned) into `block_ids` (new blocks the request holds) on
        the I/O thread; their pins end with the load."""
        ready = None
        if self._cuda:  # the blocks' earlier users (and their offload copies) are on this stream
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.caches[0].device))
        self.loads_in_flight += 1
        self.io.submit(LoadJob(request_id, sources, block_ids, ready))

    def poll(self, timeout: float = 0.0) -> list[LoadResult]:
        """Apply finished jobs; the loads among them, done or failed. Waits up to
        `timeout` for one job when none has finished."""
        results = []
        for job in self.io.take_done(timeout):
            if isinstance(job, SealJob):
                self._sealed(job)
                continue
            if isinstance(job, DropJob):
                continue
            self.loads_in_flight -= 1
            self.unpin(job.sources)
            if job.error is not None:
                self._failed += 1
                if job.bad is not None and job.bad[0] == SHARED:
                    job.missing.append(job.bad[1].block_hash)
                elif job.bad is not None:
                    self._index(job.bad[0]).drop(job.bad[1])
                if job.missing and self.shared is not None:
                    self.shared.forget(job.missing)
                logger.warning("KV tier load for request %r failed, computing instead: %s", job.request_id, job.error)
            else:
                for tier, _ in job.sources:
                    if tier == SHARED:
                        self._shared_hits += 1
                    else:
                        self._index(tier).hits += 1
                self._loaded += len(job.sources) * self.block_bytes
                self._loads += 1
                self._load_seconds += job.seconds
            results.append(LoadResult(job.request_id, job.error))
        return results

    def _sealed(self, job: SealJob) -> None:
        self._staged -= job.staged is not None
        for index, entry, error in ((self.host, job.entry, job.error), (self.disk, job.disk_entry,
                                                                         job.error or job.disk_error)):
            if entry is None or index is None:
                continue
            if error is None:
                assert job.checksum is not None  # a seal without an error has one
                index.seal(entry, job.checksum)
            index.unpin(entry)
            if error is not None:
                index.drop(entry)
        if job.error is not None:
            logger.warning("KV tier could not store block %#x: %s", job.block.block_hash, job.error)
        if job.disk_error is not None:
            # A full disk fails every write: one line per 1,000, not one per block.
            self._disk_errors += 1
            if self._disk_errors % 1000 == 1:
                logger.warning("KV disk tier could not write a block (%d so far; the block stays in the "
                               "other tiers): %s", self._disk_errors, job.disk_error)

    def _index(self, name: str) -> SlotIndex:
        if name == HOST:
            return self.host
        assert self.disk is not None
        return self.disk

    def stats(self) -> OffloadStats:
        usage = [TierUsage(i.name, i.num_slots, i.num_used, i.hits) for i in self.indexes]
        if self.shared is not None:  # the store's capacity in blocks of ours; the blocks of ours it holds
            capacity = self.shared.usage()[0] // self.block_bytes
            usage.append(TierUsage(SHARED, capacity, self.shared.blocks(), self._shared_hits))
        return OffloadStats(tuple(usage),
                            self._offloaded, self._loaded, self._loads, self._load_seconds, self._failed,
                            self._dropped)

    def close(self) -> None:
        self.io.close()
        if self.shared is not None:
            self.shared.close()
        if self._disk_store is not None:
            self._disk_store.close()
