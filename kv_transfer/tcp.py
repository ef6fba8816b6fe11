"""tcp: the fallback that works anywhere. The block bytes travel in the notification
itself, as ZMQ frames (one per run, zero-copy from the cache on CPU), and the
receiver copies them into its cache only after checking the reservation.

Zero-copy means ZMQ reads the sender's cache until it has sent the frames (or dropped
them): each write keeps its frames' MessageTracker, and is reported done or failed only
once ZMQ has let go of them (_source_in_use), since the caller then reuses its source
blocks. Frames stay queued while the peer does not read, even once it is dead (ZMQ
keeps them for a reconnection); a write that times out so, or peer_gone(), closes the
socket (linger 0), which drops them (control.py: ControlPlane.reconnect).
"""

from __future__ import annotations

from typing import Any

import torch
import zmq

from kv_transfer.base import KVTransport
from kv_transfer.control import Peer
from kv_transfer.sender import Write


class TcpTransport(KVTransport):
    name = "tcp"
    one_sided = False

    def _register(self, kv_cache: torch.Tensor) -> dict[str, Any]:
        return {}

    def _connect(self, peer: Peer) -> None:
        pass

    def _start(self, peer: Peer, write: Write) -> None:
        pass  # the data goes with the notification (_data_frames)

    def _data_frames(self, write: Write) -> list[Any]:
        frames = []
        for src, _, n in write.runs:
            run = self._blocks_bytes[src:src + n]
            # zmq reads host memory; a GPU cache is staged through a host copy.
            frames.append(memoryview(run.cpu().numpy() if run.is_cuda else run.numpy()).cast("B"))
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

    def _apply(self, sender: str, xfer: int, runs: list[list[int]], frames: list[Any]) -> None:
        if len(runs) != len(frames):
            raise ValueError(f"{len(runs)} runs but {len(frames)} data frames")
        for (dst, n), frame in zip(runs, frames):
            data = torch.frombuffer(frame.buffer, dtype=torch.uint8)
            if data.numel() != n * self._blocks_bytes.shape[1]:
                raise ValueError(f"a run of {n} blocks came with {data.numel()} bytes")
            self._blocks_bytes[dst:dst + n].copy_(data.view(n, -1))
