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

from engine.kv_cache.tier_store import DiskStore, HostStore, TierEntry


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
    """Hash a block just copied into a host slot and write it through to a disk slot."""

    entry: TierEntry
    disk_entry: TierEntry | None
    copied: torch.cuda.Event | None  # on CUDA: the device-to-host copy is done once this is
    checksum: int | None = None
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


class TierIO:
    """One daemon thread running jobs, loads first; finished jobs wait in `done`."""

    def __init__(self, caches: Sequence[torch.Tensor], host: HostStore, disk: DiskStore | None,
                 seed: int) -> None:
        self.caches, self.host, self.disk, self.seed = list(caches), host, disk, seed
        self._jobs: queue.PriorityQueue[tuple[int, int, SealJob | LoadJob | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self.done: queue.SimpleQueue[SealJob | LoadJob] = queue.SimpleQueue()
        self.pending = 0  # submitted, not yet taken from done (the engine's thread counts)
        cuda = self.caches[0].device.type == "cuda"
        self._stream = torch.cuda.Stream(self.caches[0].device) if cuda else None
        self._thread = threading.Thread(target=self._run, name="kv-tier-io", daemon=True)
        self._thread.start()

    def submit(self, job: SealJob | LoadJob) -> None:
        self.pending += 1
        self._jobs.put((0 if isinstance(job, LoadJob) else 1, next(self._order), job))

    def take_done(self, timeout: float = 0.0) -> list[SealJob | LoadJob]:
        """Finished jobs; waits up to `timeout` for the first when none is."""
        out: list[SealJob | LoadJob] = []
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
        pieces = self.host.pieces(job.entry.slot)
        job.checksum = checksum(pieces, self.seed)
        if job.disk_entry is not None:
            assert self.disk is not None  # a disk entry is made only with a disk tier
            self.disk.write(job.disk_entry.slot, pieces)

    def _load(self, job: LoadJob) -> None:
        if job.ready is not None:
            assert self._stream is not None
            self._stream.wait_event(job.ready)
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            for (tier, entry), block_id in zip(job.sources, job.block_ids):
                if tier == "host":
                    pieces: Sequence[torch.Tensor | memoryview] = self.host.pieces(entry.slot)
                else:
                    assert self.disk is not None
                    pieces = self.disk.split(self.disk.read(entry.slot))
                if checksum(pieces, self.seed) != entry.checksum:
                    job.bad = (tier, entry)
                    raise CorruptBlock(f"{tier} tier block {entry.block_hash:#x} (slot {entry.slot}) "
                                       "does not match its checksum")
                for cache, piece in zip(self.caches, pieces):
                    src = piece if isinstance(piece, torch.Tensor) else _tensor(piece, cache)
                    cache[block_id].copy_(src, non_blocking=self._stream is not None)
        if self._stream is not None:
            self._stream.synchronize()
        job.seconds = time.monotonic() - job.started


def _tensor(data: memoryview, cache: torch.Tensor) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=cache.dtype).view(cache.shape[1:])

