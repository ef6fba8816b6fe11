"""Where offloaded KV blocks live: a host tier (memory) and a disk tier (one file).

Each tier is a fixed number of block-sized slots and an index in LRU order. A slot
holds one block of every rank cache the engine reaches (every rank's on CPU at tensor
parallel > 1), one piece per rank. An entry names its block as the device prefix cache
does, by its chained hash, checked against (parent hash, token ids); its checksum covers
its bytes, seeded with the engine's namespace (model, dtype, layout, ranks), so bytes
written by another configuration, or changed since, never pass (tier_io.checksum).

Only the engine's thread touches an index. The tier's I/O thread (tier_io.py) reads and
writes slots, each one pinned while it does.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.kv_cache.events import KVEvents

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, leaving their bytes as they are
_POPULATE_CHUNK = 64 << 20


@dataclass(eq=False)
class TierEntry:
    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]
    slot: int
    checksum: int | None = None  # None until sealed (the I/O thread hashes the bytes it stored)
    pins: int = 0  # jobs reading or writing its slot; the slot is not reused before they end
    dropped: bool = False  # left its index: evicted (its slot reused at once) or dropped (freed at the last unpin)


class SlotIndex:
    """One tier's slots: block hash -> entry, least recently used first, and free slots.
    Its sealed entries coming and going are events (engine/kv_cache/events.py) while
    `events` is set."""

    def __init__(self, name: str, tier: int, num_slots: int) -> None:
        self.name = name
        self.tier = tier
        self.events: KVEvents | None = None
        self.num_slots = num_slots
        self.entries: OrderedDict[int, TierEntry] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self.hits = 0  # blocks loaded back from this tier

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def lookup(self, parent_hash: int, block_hash: int, token_ids: Sequence[int]) -> TierEntry | None:
        """The sealed entry holding exactly these tokens after this parent (now the most
        recently used), if any."""
        entry = self.entries.get(block_hash)
        if (entry is None or entry.checksum is None or entry.parent_hash != parent_hash
                or entry.token_ids != tuple(token_ids)):
            return None
        self.entries.move_to_end(block_hash)
        return entry

    def touch(self, block_hash: int) -> bool:
        """Mark the block's entry most recently used; False: the tier has none."""
        if block_hash not in self.entries:
            return False
        self.entries.move_to_end(block_hash)
        return True

    def take_slot(self) -> int | None:
        """A free slot, evicting the least recently used sealed entry that no job
        reads; None when every slot is busy (the caller drops the block)."""
        if self._free:
            return self._free.pop()
        victim = next((e for e in self.entries.values() if e.pins == 0 and e.checksum is not None), None)
        if victim is None:
            return None
        del self.entries[victim.block_hash]
        victim.dropped = True  # its slot passes to the caller
        if self.events is not None:
            self.events.record(victim.block_hash, self.tier, False)
        return victim.slot

    def add(self, entry: TierEntry) -> None:
        """A new entry, not found until seal()."""
        self.entries[entry.block_hash] = entry

    def seal(self, entry: TierEntry, checksum: int) -> None:
        """Its bytes are stored and checksummed: lookups find it from now on."""
        entry.checksum = checksum
        if self.events is not None and not entry.dropped:
            self.events.record(entry.block_hash, self.tier, True)

    def drop(self, entry: TierEntry) -> None:
        """Forget one of this index's entries (its bytes are bad, or its seal failed);
        its slot is free once no job holds it."""
        if entry.dropped:
            return
        if self.entries.get(entry.block_hash) is not entry:
            raise ValueError(f"{self.name} tier: entry {entry.block_hash:#x} is not this index's")
        del self.entries[entry.block_hash]
        entry.dropped = True
        if self.events is not None and entry.checksum is not None:
            self.events.record(entry.block_hash, self.tier, False)
        if entry.pins == 0:
            self._free.append(entry.slot)

    def unpin(self, entry: TierEntry) -> None:
        entry.pins -= 1
        if entry.pins == 0 and entry.dropped:
            self._free.append(entry.slot)


class HostStore:
    """The host tier's memory: per rank cache a [slots, *block] tensor (pinned on CUDA,
    so copies to and from the device run asynchronously)."""

    def __init__(self, block_shapes: Sequence[torch.Size], dtype: torch.dtype, num_slots: int,
                 pin: bool) -> None:
        self.buffers = [torch.empty((num_slots, *shape), dtype=dtype, pin_memory=pin) for shape in block_shapes]
        if not pin:  # pinned memory is locked in, page by page, as it is allocated
            threading.Thread(target=populate, args=(self.buffers,), name="kv-tier-populate", daemon=True).start()

    def pieces(self, slot: int) -> list[torch.Tensor]:
        return [buffer[slot] for buffer in self.buffers]


def populate(buffers: Sequence[torch.Tensor]) -> None:
    """Fault the buffers' pages in, without changing a byte (so it runs alongside offloads
    into them): a first write to a fresh page costs its fault and zeroing, which made
    each offload copy 4x slower until every slot had been used once; paid here, on a
    thread of its own while the engine warms up, instead of by the steps."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    for buffer in buffers:
        start = -(-buffer.data_ptr() // page) * page
        end = (buffer.data_ptr() + buffer.numel() * buffer.element_size()) // page * page
        for at in range(start, end, _POPULATE_CHUNK):
            size = min(_POPULATE_CHUNK, end - at)
            if libc.madvise(ctypes.c_void_p(at), ctypes.c_size_t(size), _MADV_POPULATE_WRITE) != 0:
                # An older kernel (EINVAL): the steps pay the faults, nothing else changes.
                logger.debug("host tier: madvise(MADV_POPULATE_WRITE) failed: %s", os.strerror(ctypes.get_errno()))
                return


class DiskStore:
    """The disk tier: one file of slots under the given directory, read and written with
    pread/pwrite (whole slots, so the file stays the pieces' bytes one after another).
    The file is this engine's alone, unlinked as soon as it is open (its space is
    freed when the process closes it or dies): a restarted engine starts with an empty
    disk tier."""

    def __init__(self, directory: str, block_shapes: Sequence[torch.Size], dtype: torch.dtype,
                 num_slots: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.piece_bytes = [int(np.prod(shape)) * dtype.itemsize for shape in block_shapes]
        self.slot_bytes = sum(self.piece_bytes)
        self.path = os.path.join(directory, f"pdserve-kv-{os.getpid()}-{os.urandom(4).hex()}.tier")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        # Unlinked at once: the space is this engine's only while it has the file open,
        # so a worker killed (or ended by os._exit) leaves nothing behind in the directory.
        os.unlink(self.path)
        os.ftruncate(self._fd, self.slot_bytes * num_slots)

    def write(self, slot: int, pieces: Sequence[torch.Tensor]) -> None:
        offset = slot * self.slot_bytes
        for piece in pieces:
            data = bytes_of(piece)
            if os.pwrite(self._fd, data, offset) != len(data):
                raise OSError(f"short write to {self.path}")
            offset += len(data)

    def read(self, slot: int) -> bytes:
        data = os.pread(self._fd, self.slot_bytes, slot * self.slot_bytes)
        if len(data) != self.slot_bytes:
            raise OSError(f"short read from {self.path}: {len(data)} of {self.slot_bytes} bytes")
        return data

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def bytes_of(piece: torch.Tensor) -> memoryview:
    """A contiguous host tensor's bytes, without a copy."""
    return piece.view(torch.uint8).numpy().data.cast("B")


def split(data: bytes | memoryview, piece_bytes: Sequence[int]) -> list[memoryview]:
    """A block's bytes (each rank's piece, one after another), as each rank's piece."""
    if len(data) != sum(piece_bytes):
        raise ValueError(f"a block of {len(data)} bytes, not {sum(piece_bytes)}")
    view, out, start = memoryview(data).cast("B"), [], 0
    for n in piece_bytes:
        out.append(view[start:start + n])
        start += n
    return out
