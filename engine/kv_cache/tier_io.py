"""The offload tiers' I/O thread: it seals blocks copied to the host tier (checksums
them, and writes them through to the disk tier) and loads blocks back into the KV cache,
so that no step waits on a disk or on hashing.

Jobs only move bytes between slots and blocks that are pinned for them (tier_store.py);
their results go back to the engine's thread (done), which alone updates the indexes.
Loads go ahead of seals: a request waits on a load, nothing waits on a seal.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import xxhash

from engine.kv_cache.shared_tier import SharedBlock, SharedTier
from engine.kv_cache.tier_store import DiskStore, HostStore, TierEntry, bytes_of, split

SHARED = "shared"  # a load source's tier name: the deployment's KV store (shared_tier.py)
FETCH_BATCH_BYTES = 32 << 20  # blocks asked of the store per round trip, at most (one, if larger)


def checksum(pieces: Sequence[torch.Tensor | memoryview], seed: int) -> int:
    """xxh3 over each rank's piece in turn, starting from the engine's namespace."""
    h = seed
    for piece in pieces:
        data = piece if isinstance(piece, memoryview) else piece.view(torch.uint8).numpy().data
        h = xxhash.xxh3_64_intdigest(data, seed=h)
    return h


class CorruptBlock(Exception):
    """A tier's bytes do not match the checksum they were stored with."""


@dataclass(eq=False)
class SealJob:
    """Hash a block just copied into a host slot and write it through to a disk slot;
    or, with every host slot busy, copied into `staged` for the disk slot alone."""

    block: TierEntry  # which block (its hash, parent and tokens)
    entry: TierEntry | None  # its host entry
    disk_entry: TierEntry | None
    copied: torch.cuda.Event | None  # on CUDA: the device-to-host copy is done once this is
    staged: list[torch.Tensor] | None = None  # the block's pieces, when it has no host entry
    checksum: int | None = None
    error: str | None = None  # the block is in no tier
    disk_error: str | None = None  # its disk write failed: the disk entry alone goes


@dataclass(eq=False)
class DropJob:
    """Send the StoreDrops KVTiers.revoke queued (SharedTier.send_drops): queued with the
    seals, so after any seal (and put) of those blocks."""

    error: str | None = None


@dataclass(eq=False)
class LoadJob:
    """Copy tier blocks (host or disk, in prefix order) into KV blocks, checking each."""

    request_id: str
    sources: list[tuple[str, TierEntry]]  # (tier name, entry)
    block_ids: list[int]
    ready: torch.cuda.Event | None  # on CUDA: the blocks' earlier users on the step stream are done
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0
    error: str | None = None
    bad: tuple[str, TierEntry] | None = None  # (tier, entry) whose bytes failed their checksum
    missing: list[int] = field(default_factory=list)  # shared blocks the store did not bring


class TierIO:
    """One daemon thread running jobs, loads first; finished jobs wait in `done`."""

    def __init__(self, caches: Sequence[torch.Tensor], host: HostStore, disk: DiskStore | None,
                 seed: int, mirrors: Sequence[torch.Tensor] = ()) -> None:
        self.caches, self.host, self.disk, self.seed = list(caches), host, disk, seed
        self.mirrors = list(mirrors)  # rank caches holding caches[0]'s bytes (kv_cache/tiers.py)
        self.shared: SharedTier | None = None
        self._piece_bytes = [c[0].numel() * c.element_size() for c in self.caches]
        self._jobs: queue.PriorityQueue[tuple[int, int, SealJob | DropJob | LoadJob | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self.done: queue.SimpleQueue[SealJob | DropJob | LoadJob] = queue.SimpleQueue()
        self.pending = 0  # submitted, not yet taken from done (the engine's thread counts)
        cuda = self.caches[0].device.type == "cuda"
        self._stream = torch.cuda.Stream(self.caches[0].device) if cuda else None
        self._thread = threading.Thread(target=self._run, name="kv-tier-io", daemon=True)
        self._thread.start()

    def submit(self, job: SealJob | DropJob | LoadJob) -> None:
        self.pending += 1
        self._jobs.put((0 if isinstance(job, LoadJob) else 1, next(self._order), job))

    def take_done(self, timeout: float = 0.0) -> list[SealJob | DropJob | LoadJob]:
        """Finished jobs; waits up to `timeout` for the first when none is."""
        out: list[SealJob | DropJob | LoadJob] = []
        try:
            out.append(self.done.get(timeout=timeout) if timeout > 0 else self.done.get_nowait())
            while True:
                out.append(self.done.get_nowait())
        except queue.Empty:
            pass
        self.pending -= len(out)
        return out

    def close(self) -> None:
        self._jobs.put((-1, -1, None))
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            _, _, job = self._jobs.get()
            if job is None:
                return
            try:
                if isinstance(job, SealJob):
                    self._seal(job)
                elif isinstance(job, DropJob):
                    if self.shared is not None:
                        self.shared.send_drops()
                else:
                    self._load(job)
            except CorruptBlock as exc:
                job.error = str(exc)
            except Exception as exc:  # a disk error, a device error: the job fails, the engine goes on
                job.error = f"{type(exc).__name__}: {exc}"
            self.done.put(job)

    def _seal(self, job: SealJob) -> None:
        if job.copied is not None:
            job.copied.synchronize()
        pieces = job.staged if job.entry is None else self.host.pieces(job.entry.slot)
        assert pieces is not None  # a seal without a host entry has its pieces staged
        job.checksum = checksum(pieces, self.seed)
        if job.disk_entry is not None:
            assert self.disk is not None  # a disk entry is made only with a disk tier
            try:
                self.disk.write(job.disk_entry.slot, pieces)
            except OSError as exc:  # a full or failing disk: the block is kept in the other tiers
                job.disk_error = f"{type(exc).__name__}: {exc}"
        e = job.block
        if self.shared is not None and not self.shared.holds(e.block_hash):
            self.shared.put(SharedBlock(e.block_hash, e.parent_hash, e.token_ids, job.checksum,
                                        b"".join(bytes_of(p) for p in pieces)))

    def _load(self, job: LoadJob) -> None:
        if job.ready is not None:
            assert self._stream is not None
            self._stream.wait_event(job.ready)
        fetched = self._fetch(job)
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            for (tier, entry), block_id in zip(job.sources, job.block_ids):
                try:
                    self._load_one(tier, entry, block_id, fetched)
                except Exception:
                    # Whatever failed (its bytes, a disk read), the entry goes: the
                    # request's retry computes this block instead of trying it again.
                    job.bad = (tier, entry)
                    raise
        if self._stream is not None:
            self._stream.synchronize()
        job.seconds = time.monotonic() - job.started

    def _load_one(self, tier: str, entry: TierEntry, block_id: int, fetched: dict[int, SharedBlock]) -> None:
        if tier == "host":
            pieces: Sequence[torch.Tensor | memoryview] = self.host.pieces(entry.slot)
        elif tier == SHARED:
            block = fetched[entry.block_hash]
            if block.parent_hash != entry.parent_hash or block.token_ids != entry.token_ids:
                raise CorruptBlock(f"shared tier block {entry.block_hash:#x} holds other tokens")
            entry.checksum = block.checksum
            pieces = split(block.data, self._piece_bytes)
        else:
            assert self.disk is not None
            pieces = split(self.disk.read(entry.slot), self._piece_bytes)
        if checksum(pieces, self.seed) != entry.checksum:
            raise CorruptBlock(f"{tier} tier block {entry.block_hash:#x} (slot {entry.slot}) "
                               "does not match its checksum")
        for cache, piece in zip(self.caches, pieces):
            src = piece if isinstance(piece, torch.Tensor) else _tensor(piece, cache)
            cache[block_id].copy_(src, non_blocking=self._stream is not None)
        for mirror in self.mirrors:
            mirror[block_id].copy_(self.caches[0][block_id], non_blocking=self._stream is not None)

    def _fetch(self, job: LoadJob) -> dict[int, SharedBlock]:
        """The load's shared blocks, by hash, fetched in one round trip; all of them, or
        the load fails with job.missing naming those the store did not bring."""
        wanted = [e.block_hash for tier, e in job.sources if tier == SHARED]
        if not wanted:
            return {}
        assert self.shared is not None  # a shared source is found only with a shared tier
        job.missing = wanted  # until the store answers
        # In batches of bounded bytes, each a round trip of its own within the client's
        # fetch timeout: one fetch of a long chain would outlast any timeout on a slow link.
        per_batch = max(1, FETCH_BATCH_BYTES // sum(self._piece_bytes))
        got: list[SharedBlock] = []
        for at in range(0, len(wanted), per_batch):
            batch = self.shared.fetch(wanted[at:at + per_batch])
            got += batch
            if len(batch) < len(wanted[at:at + per_batch]):
                break
        job.missing = wanted[len(got):]
        if job.missing:
            raise CorruptBlock(f"the shared tier no longer holds {len(job.missing)} of {len(wanted)} blocks")
        return {b.block_hash: b for b in got}


def _tensor(data: memoryview, cache: torch.Tensor) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=cache.dtype).view(cache.shape[1:])

