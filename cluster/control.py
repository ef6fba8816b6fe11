"""The control channel between a launcher and one worker it started.

A worker's `serve(config, index, control)` uses three calls on `control`, in this
order: `send_bytes(ready)` once (its ZMQ address and transport metadata,
router/protocol.py "ready"), `recv_bytes()` once (its peers, "peers"), then `poll()`
after every loop iteration: True means stop. The local launcher passes one end of a
multiprocessing Pipe (a closed pipe also polls True, so a dead launcher stops its
workers); the Ray launcher passes a `QueueControl`, whose other end is driven by the
actor's methods (cluster/ray_actor.py). Messages stay msgpack bytes either way.
"""

from __future__ import annotations

import queue
from collections.abc import Sequence
from typing import Protocol

from router.protocol import encode


class ControlChannel(Protocol):
    def send_bytes(self, data: bytes) -> None: ...

    def recv_bytes(self) -> bytes: ...

    def poll(self) -> bool:
        """Without waiting: is there a message (or is the channel closed)?"""
        ...


class QueueControl:
    """A ControlChannel between threads of one process: the worker thread holds this
    object, the launcher's side calls `to_worker` / `from_worker`."""

    def __init__(self) -> None:
        self._inbox: queue.Queue[bytes] = queue.Queue()   # launcher -> worker
        self._outbox: queue.Queue[bytes] = queue.Queue()  # worker -> launcher

    # --- the worker's end (ControlChannel) ---
    def send_bytes(self, data: bytes) -> None:
        self._outbox.put(bytes(data))

    def recv_bytes(self) -> bytes:
        return self._inbox.get()

    def poll(self) -> bool:
        return not self._inbox.empty()  # only the worker thread reads: no race to lose

    # --- the launcher's end ---
    def to_worker(self, data: bytes) -> None:
        self._inbox.put(data)

    def from_worker(self, timeout: float) -> bytes | None:
        """The worker's next message, or None if none came within `timeout` seconds."""
        try:
            return self._outbox.get(timeout=timeout)
        except queue.Empty:
            return None


class _Started(Protocol):
    name: str
    address: str  # its ZMQ address, from its "ready" message
    metadata: bytes  # its transport metadata, from its "ready" message


def peers_messages(decode_workers: Sequence[_Started], prefill_workers: Sequence[_Started]) -> tuple[bytes, bytes]:
    """The "peers" message for every decode worker and for every prefill worker: decode
    workers connect to the prefill workers' ZMQ addresses; prefill workers add the
    decode workers' transports as KV destinations."""
    prefill = {w.name: w.address for w in prefill_workers}
    return (encode("peers", prefill=prefill, decode=[]),
            encode("peers", prefill={}, decode=[w.metadata for w in decode_workers]))
