"""shm: same host, CPU. The receiver's KV cache lives in a file under /dev/shm that the
sender maps (a TP worker: one file per rank, made by its engine, all mapped by the
worker's driver); a write is a plain memory copy of each run (of each rank pair's heads,
rank_pairs.py), made by a worker thread in one GIL-free call per chunk of at most
CHUNK_BYTES, then the notification.

The copy is bounded in time where it runs (_copy): one that starts after the
reservation's deadline (the pool was busy, the host overloaded) does not start, and
one still running at deadline + cancel_grace_s / 2 stops before its next chunk, so,
unless one chunk takes longer than cancel_grace_s / 2, no byte lands once the receiver
may have released the blocks (deadline + cancel_grace_s); the write fails then. Its
notification still goes out, so a receiver that did release them hears of the landing
(Overwritten).

Every segment is created 0600 whatever the umask, and a sender maps a peer's announced
segment only if it is one of pdserve's (shm_segments.segment_name_problem), not a
symbolic link, a regular file, this user's, and reachable by no one else
(_open_peer_segment): an announced path cannot make it map any other file."""

from __future__ import annotations

import errno
import mmap
import os
import stat
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kv_transfer.base import KVTransport, TransportConfig
from kv_transfer.compat import IncompatiblePeerError
from kv_transfer.control import Peer
from kv_transfer.sender import Write
from kv_transfer.shm_segments import PREFIX, SHM_DIR, segment_name_problem

# Bytes copied per GIL-free call, between two checks of the write's time bound (a block
# larger than this is one chunk): small enough that a copy stops soon after its bound,
# large enough that retaking the GIL once per chunk costs next to nothing
# (docs/benchmarks/2026-11-29-kv-transfer.md). A write up to this size is one call.
CHUNK_BYTES = 64 << 20
_copy_chunk = torch._foreach_copy_  # what moves one chunk (tests slow it down here)


def _create_segment(path: str, size: int) -> tuple[mmap.mmap, torch.Tensor]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask may have taken the owner's bits too
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return m, torch.frombuffer(m, dtype=torch.uint8)


def _open_peer_segment(path: object, size: int) -> tuple[mmap.mmap, torch.Tensor]:
    """Map a segment a peer announced; IncompatiblePeerError naming the path unless it is
    a pdserve segment that only this user can reach, of the announced size."""
    problem = segment_name_problem(path)
    if problem is not None:
        raise IncompatiblePeerError(f"refused the announced KV segment: {problem}")
    assert isinstance(path, str)  # segment_name_problem refused anything else
    try:  # O_NONBLOCK: a FIFO or device put there must not hang the open
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise IncompatiblePeerError(f"refused the announced KV segment {path!r}: {why}") from None
    try:
        st = os.fstat(fd)
        problem = ("it is not a regular file" if not stat.S_ISREG(st.st_mode) else
                   f"it belongs to uid {st.st_uid}, not to this user ({os.geteuid()})" if st.st_uid != os.geteuid()
                   else f"others than its owner can reach it (mode {stat.S_IMODE(st.st_mode):o})"
                   if st.st_mode & 0o077 else
                   f"it holds {st.st_size} bytes, the peer announced {size}" if st.st_size != size else None)
        if problem is not None:
            raise IncompatiblePeerError(f"refused the announced KV segment {path!r}: {problem}")
        m = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return m, torch.frombuffer(m, dtype=torch.uint8)


def _regions(write: Write, dst: list[torch.Tensor], src: list[torch.Tensor],
             num_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The write as (destination, source) views of the ranks' caches (as [blocks,
    heads, layers, bytes]), one pair per run of each piece: a whole piece's run of
    every layer is one contiguous region; another piece's heads, or a layer range, a
    strided view (one region per block or head, moved by the same copy call)."""
    l0, l1 = write.layers or (0, num_layers)
    regions = []
    for p in write.pieces:
        to, frm = dst[p.dst_rank], src[p.src_rank]
        so, do, k = p.src_head, p.dst_head, p.num_heads
        regions += [(to[d:d + n, do:do + k, l0:l1], frm[s:s + n, so:so + k, l0:l1]) for s, d, n in write.runs]
    return regions


def _chunks(regions: list[tuple[torch.Tensor, torch.Tensor]],
            limit: int) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The (destination, source) [blocks, ...] views grouped into chunks of at most
    `limit` bytes (at least one block each); a view larger than that is split between
    blocks. One loop step per view or chunk."""
    chunks: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    to: list[torch.Tensor] = []
    frm: list[torch.Tensor] = []
    room = limit
    for dst, src in regions:
        n, row, i = dst.shape[0], dst[0].numel(), 0
        while i < n:
            k = min(n - i, room // max(1, row))
            if k <= 0:
                if to:  # the chunk is full: the next block starts another
                    chunks.append((to, frm))
                    to, frm, room = [], [], limit
                    continue
                k = 1  # a block larger than the limit is a chunk of its own
            whole = i == 0 and k == n  # the common case: no second slice
            to.append(dst if whole else dst[i:i + k])
            frm.append(src if whole else src[i:i + k])
            room, i = room - k * row, i + k
    if to:
        chunks.append((to, frm))
    return chunks


def _copy(chunks: list[tuple[list[torch.Tensor], list[torch.Tensor]]], deadline: float,
          stop_at: float) -> str | None:
    """A write's copy, on a pool thread. It does not start after the reservation's
    `deadline` (raises: no byte landed), and stops before a chunk once past `stop_at`
    (time.time()). Returns why it stopped, if it did: the chunks copied have landed
    (maybe late: a chunk started in time may take any time), so the receiver must still
    hear of them (the write's notification), and the write fails."""
    if time.time() > deadline:
        raise RuntimeError("deadline passed before the copy started")
    for i, (to, frm) in enumerate(chunks):
        if i and time.time() > stop_at:
            return (f"copy stopped after {i} of {len(chunks)} chunks: still running at the reservation's "
                    "deadline + cancel_grace_s / 2")
        _copy_chunk(to, frm)
    return None


class ShmTransport(KVTransport):
    name = "shm"
    one_sided = True
    multi_rank = True

    def __init__(self, agent_name: str, config: TransportConfig | None = None) -> None:
        super().__init__(agent_name, config)
        self._path: str | None = None  # our segment, if we allocated one
        self._maps: list[mmap.mmap] = []  # ours, and peers' still viewed when they went
        self._peer_maps: dict[str, list[mmap.mmap]] = {}
        self._peer_bytes: dict[str, list[torch.Tensor]] = {}  # each rank's cache, [blocks, heads, layers, bytes]
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"shm-{agent_name}")

    def allocate_kv_cache(self, shape: Sequence[int], dtype: torch.dtype, device: str) -> torch.Tensor:
        if device != "cpu":
            raise ValueError(f"the shm transport holds a CPU cache, not {device!r} (use cuda_ipc on GPUs)")
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        self._path = os.path.join(SHM_DIR, f"{PREFIX}{uuid.uuid4().hex}")
        m, raw = _create_segment(self._path, nbytes)
        self._maps.append(m)
        return raw.view(dtype).view(tuple(shape))

    def _register(self, kv_cache: torch.Tensor) -> dict[str, Any]:
        sizes = [c.numel() * c.element_size() for c in self.kv_caches]
        if self._files is not None:  # the rank caches' own files (a TP worker's engine made them)
            paths = self._files
            for r, (path, size) in enumerate(zip(paths, sizes)):
                problem = segment_name_problem(path)
                if problem is not None:  # its peers would refuse it
                    raise ValueError(f"rank {r}'s cache file: {problem}")
                found = os.stat(path).st_size if os.path.exists(path) else None
                if found != size:
                    raise ValueError(f"rank {r}'s cache file {path} holds {found} bytes, its cache {size}")
        elif self._path is not None and len(sizes) == 1:
            paths = [self._path]
        else:
            raise ValueError("the shm transport can only register a cache it allocated (allocate_kv_cache), "
                             "or rank caches with the /dev/shm files that hold them (files=)")
        return {"paths": list(paths), "bytes": sizes}

    def _connect(self, peer: Peer) -> None:
        paths, sizes = peer.data.get("paths"), peer.data.get("bytes")
        if (not isinstance(paths, list) or not isinstance(sizes, list) or len(paths) != peer.compat.tp_size
                or len(sizes) != len(paths) or not all(type(n) is int and n > 0 for n in sizes)):
            raise IncompatiblePeerError(f"peer {peer.name!r} announced cache files {paths!r} of {sizes!r} bytes "
                                        f"for its {peer.compat.tp_size} ranks")
        mapped: list[tuple[mmap.mmap, torch.Tensor]] = []
        try:
            for path, size in zip(paths, sizes):
                mapped.append(_open_peer_segment(path, size))
            views = [raw.view(peer.data["num_blocks"], heads, peer.compat.num_layers, -1)
                     for (_, raw), heads in zip(mapped, peer.compat.local_heads)]
        except BaseException:
            self._maps += [m for m, _ in mapped]  # unmapped at close()
            raise
        maps = [m for m, _ in mapped]
        self._peer_maps[peer.name] = maps
        self._peer_bytes[peer.name] = views

    def _disconnect(self, name: str) -> None:
        # Unmapped now if nothing still views it (the pages of a dead peer's cache go
        # once its file is unlinked too), else at close().
        self._peer_bytes.pop(name, None)
        for m in self._peer_maps.pop(name, []):
            try:
                m.close()
            except BufferError:  # a copy still holds a view
                self._maps.append(m)

    def _start(self, peer: Peer, write: Write) -> None:
        # One call per chunk of every run: a Python loop of copies per run would retake
        # the GIL between runs and stall behind the polling thread (docs/benchmarks/2026-11-29-kv-transfer.md).
        regions = _regions(write, self._peer_bytes[peer.name], self._rank_layers, self.registered_compat.num_layers)
        chunks = _chunks(regions, CHUNK_BYTES)
        write.handle = self._pool.submit(_copy, chunks, write.deadline,
                                         write.deadline + self.config.cancel_grace_s / 2)

    def _progress(self, write: Write) -> bool:
        handle: Future | None = write.handle
        if handle is None or not handle.done():
            return handle is None
        stopped = handle.result()  # re-raises a copy error (nothing landed)
        if isinstance(stopped, str):  # part landed: notified, then failed (_notify_when_landed)
            write.failure = write.failure or stopped
        return True

    def _source_in_use(self, write: Write) -> bool:
        handle: Future | None = write.handle
        return handle is not None and not handle.done()  # its copy still runs (peer_gone)

    def _close(self) -> None:
        self._pool.shutdown(wait=True)
        self._peer_bytes.clear()
        self.kv_cache = None
        self._blocks_bytes = None  # type: ignore[assignment]  # its views of the mapping, dropped so the maps close
        self._rank_bytes, self._rank_layers = [], []
        for m in self._maps + [m for maps in self._peer_maps.values() for m in maps]:
            try:
                m.close()
            except BufferError:  # a tensor view still exists; the mapping goes with it
                pass
        if self._path is not None:
            path, self._path = self._path, None
            try:
                os.unlink(path)
            except FileNotFoundError:  # already removed by the launcher (unlink_segment)
                pass
