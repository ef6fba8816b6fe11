"""tcp: the fallback that works anywhere. The block bytes travel in the notification
itself, as ZMQ frames (one per descriptor: per run, or per block of a rank pair's heads
between TP sizes; zero-copy from the cache on CPU), and the receiver copies them into
its caches only after checking the reservation.

Zero-copy means ZMQ reads the sender's cache until it has sent the frames (or dropped
them): each write keeps its frames' MessageTracker, and is reported done or failed only
once ZMQ has let go of them (_source_in_use), since the caller then reuses its source
blocks. Frames stay queued while the peer does not read, even once it is dead (ZMQ
keeps them for a reconnection); a write that times out so, or peer_gone(), closes the
socket (linger 0), which drops them (control.py: ControlPlane.reconnect).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import zmq

from kv_transfer.base import KVTransport
from kv_transfer.control import Peer
from kv_transfer.sender import Write
from protocol.kv_control import Layers, Piece, Run


class TcpTransport(KVTransport):
    name = "tcp"
    one_sided = False
    multi_rank = True
    fabric = "tcp"
    # One ZMQ frame per descriptor, and CURVE encrypts and decrypts a frame whole: frames
    # of about 1 MiB keep encryption, the wire and decryption moving at once. Whole runs
    # (47 MB for a 1k-token prompt of the demo) exposed 1.5-2.7x the push time across
    # loopback with CURVE (docs/benchmarks/2026-12-06-kv-streaming.md); plain tcp moved
    # 1 MiB descriptors as fast as 4 MiB ones (2026-11-29-kv-transfer.md).
    max_run_bytes = 1 << 20
    gathers_layers = True  # a layer range of a run: gathered into one frame

    def _register(self, kv_cache: torch.Tensor) -> dict[str, Any]:
        return {}

    def _connect(self, peer: Peer) -> None:
        pass

    def _start(self, peer: Peer, write: Write) -> None:
        pass  # the data goes with the notification (_data_frames)

    def _data_frames(self, write: Write) -> list[Any]:
        # One frame per descriptor (rank_pairs.count_descriptors, but a layer range's
        # heads of a run, gathered into one frame), in the order of the write's pieces:
        # a whole piece's run is one region, any other piece's heads are one per block.
        frames = []
        l0, l1 = write.layers or (0, self.registered_compat.num_layers)
        for p in write.pieces:
            src = self._rank_layers[p.src_rank]
            heads = slice(p.src_head, p.src_head + p.num_heads)
            if p.whole:
                regions = [src[s:s + n, :, l0:l1] for s, _, n in write.runs]
            else:
                regions = [src[b, heads, l0:l1] for s, _, n in write.runs for b in range(s, s + n)]
            # Every layer of a region is contiguous: sent zero-copy. A layer range is
            # gathered into a new buffer; zmq reads host memory, so a GPU cache is staged.
            frames += [(r.cpu() if r.is_cuda else r.contiguous()).numpy().data.cast("B") for r in regions]
        return frames

    def _send_notification(self, peer: Peer, write: Write) -> None:
        frames = [self._header(write), *self._data_frames(write)]
        # Frame by frame (what send_multipart does), to track each: send_multipart
        # returns the tracker of the last frame only.
        trackers = [peer.socket.send(frame, zmq.SNDMORE if i < len(frames) - 1 else 0, copy=False, track=True)
                    for i, frame in enumerate(frames)]
        write.handle = zmq.MessageTracker(*trackers)

    def _source_in_use(self, write: Write) -> bool:
        return write.handle is not None and not write.handle.done

    def _apply(self, sender: str, xfer: int, runs: Sequence[Run], pieces: Sequence[Piece],
               frames: list[Any], layers: Layers | None) -> None:
        # The frames in _data_frames' order; `pieces` fill every local head (receiver.py).
        blocks = sum(n for _, n in runs)
        expected = sum(len(runs) if whole else blocks for *_, whole in pieces)
        if len(frames) != expected:
            raise ValueError(f"{len(runs)} runs of {blocks} blocks in pieces {pieces} need {expected} data "
                             f"frames, got {len(frames)}")
        l0, l1 = layers or (0, self.registered_compat.num_layers)
        data = iter(frames)
        for rank, head, num_heads, whole in pieces:
            dst = self._rank_layers[rank]
            if whole:
                for d, n in runs:
                    region = dst[d:d + n, :, l0:l1]
                    run = torch.frombuffer(next(data).buffer, dtype=torch.uint8)
                    if run.numel() != region.numel():
                        raise ValueError(f"a run of {n} blocks came with {run.numel()} bytes")
                    region.copy_(run.view(region.shape))
                continue
            # One small copy per block: numpy's, on this thread (a CPU cache). torch's
            # would wake its intra-op threads for each, which stalls when the cores are busy.
            rows: Any  # the cache (GPU) or a numpy view of it (CPU): both written by [block, heads, layers] slices
            rows, as_rows = (dst, _torch_bytes) if dst.is_cuda else (dst.numpy(), _numpy_bytes)
            shape = (num_heads, l1 - l0, dst.shape[3])
            for d, n in runs:
                for b in range(d, d + n):
                    frame = next(data).buffer
                    if len(frame) != shape[0] * shape[1] * shape[2]:
                        raise ValueError(f"{num_heads} heads of a block came with {len(frame)} bytes")
                    rows[b, head:head + num_heads, l0:l1] = as_rows(frame).reshape(shape)


def _numpy_bytes(buffer: Any) -> np.ndarray:
    return np.frombuffer(buffer, dtype=np.uint8)


def _torch_bytes(buffer: Any) -> torch.Tensor:
    return torch.frombuffer(buffer, dtype=torch.uint8)
