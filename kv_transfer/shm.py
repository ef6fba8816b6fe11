"""shm: same host, CPU. The receiver's KV cache lives in a file under /dev/shm that the
sender maps; a write is a plain memory copy of each run, made by a worker thread in one
GIL-free call per chunk of at most CHUNK_BYTES, then the notification.

The copy is bounded in time where it runs (_copy): one that starts after the
reservation's deadline (the pool was busy, the host overloaded) does not start, and
one still running at deadline + cancel_grace_s / 2 stops before its next chunk, so,
unless one chunk takes longer than cancel_grace_s / 2, no byte lands once the receiver
may have released the blocks (deadline + cancel_grace_s); the write fails then. Its
notification still goes out, so a receiver that did release them hears of the landing
(Overwritten)."""

from __future__ import annotations

import mmap
import os
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kv_transfer.base import KVTransport, TransportConfig
from kv_transfer.control import Peer
from kv_transfer.sender import Write
from kv_transfer.shm_segments import SHM_DIR

# Bytes copied per GIL-free call, between two checks of the write's time bound (a block
# larger than this is one chunk): small enough that a copy stops soon after its bound,
# large enough that retaking the GIL once per chunk costs next to nothing
# (docs/benchmarks.md, KV transfer bandwidth). A write up to this size is one call.
CHUNK_BYTES = 64 << 20
_copy_chunk = torch._foreach_copy_  # what moves one chunk (tests slow it down here)


def _map(path: str, size: int, create: bool) -> tuple[mmap.mmap, torch.Tensor]:
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        elif os.fstat(fd).st_size != size:
            raise ValueError(f"{path} holds {os.fstat(fd).st_size} bytes, the peer announced {size}")
        m = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return m, torch.frombuffer(m, dtype=torch.uint8)


def _chunks(runs: list[tuple[int, int, int]], dst: torch.Tensor, src: torch.Tensor,
            limit: int) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The runs (src_start, dst_start, count) as (destination, source) views of
    [blocks, bytes] caches, grouped into chunks of at most `limit` bytes (at least one
    block each); a run larger than that is split. One loop step per run or chunk."""
    per_chunk = max(1, limit // max(1, dst.shape[1]))  # blocks
    chunks: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    to, frm, room = [], [], per_chunk
    for s, d, n in runs:
        while n:
            k = min(n, room)
            to.append(dst[d:d + k])
            frm.append(src[s:s + k])
            s, d, n, room = s + k, d + k, n - k, room - k
            if not room:
                chunks.append((to, frm))
                to, frm, room = [], [], per_chunk
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

    def __init__(self, agent_name: str, config: TransportConfig | None = None) -> None:
        super().__init__(agent_name, config)
        self._path: str | None = None  # our segment, if we allocated one
        self._maps: list[mmap.mmap] = []  # ours, and peers' still viewed when they went
        self._peer_maps: dict[str, mmap.mmap] = {}
        self._peer_bytes: dict[str, torch.Tensor] = {}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"shm-{agent_name}")

    def allocate_kv_cache(self, shape: Sequence[int], dtype: torch.dtype, device: str) -> torch.Tensor:
        if device != "cpu":
            raise ValueError(f"the shm transport holds a CPU cache, not {device!r} (use cuda_ipc on GPUs)")
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        self._path = os.path.join(SHM_DIR, f"pdserve-kv-{uuid.uuid4().hex}")
        m, raw = _map(self._path, nbytes, create=True)
        self._maps.append(m)
        return raw.view(dtype).view(tuple(shape))

    def _register(self, kv_cache: torch.Tensor) -> dict[str, Any]:
        if self._path is None:
            raise ValueError("the shm transport can only register a cache it allocated "
                             "(allocate_kv_cache)")
        return {"path": self._path, "bytes": kv_cache.numel() * kv_cache.element_size()}

    def _connect(self, peer: Peer) -> None:
        m, raw = _map(peer.data["path"], peer.data["bytes"], create=False)
        self._peer_maps[peer.name] = m
        self._peer_bytes[peer.name] = raw.view(peer.data["num_blocks"], -1)

    def _disconnect(self, name: str) -> None:
        # Unmapped now if nothing still views it (the pages of a dead peer's cache go
        # once its file is unlinked too), else at close().
        self._peer_bytes.pop(name, None)
        m = self._peer_maps.pop(name, None)
        if m is not None:
            try:
                m.close()
            except BufferError:  # a copy still holds a view
                self._maps.append(m)

    def _start(self, peer: Peer, write: Write) -> None:
        # One call per chunk of every run: a Python loop of copies per run would retake
        # the GIL between runs and stall behind the polling thread (docs/benchmarks.md).
        chunks = _chunks(write.runs, self._peer_bytes[peer.name], self._blocks_bytes, CHUNK_BYTES)
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
        self.kv_cache = self._blocks_bytes = None
        for m in self._maps + list(self._peer_maps.values()):
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
