"""The control channel between a launcher and one worker it started.

A worker's `serve(config, control)` uses three calls on `control`: `send_bytes(Ready)`
once (its ZMQ address and transport metadata, protocol/control.py), `recv_bytes()` once
(its Peers), then `poll()` after every loop iteration and, when it is True,
`recv_bytes()`: Stop ends the worker; Peers replace its peers (the launchers'
supervisors send them when a peer dies or comes back restarted).

The local launcher passes one end of a multiprocessing Pipe (a closed pipe polls True
and raises EOFError on reading, so a dead launcher stops its workers); the Ray launcher passes a `QueueControl`, whose other end is driven by the
actor's methods (cluster/ray/actor.py). Messages are protocol/ messages, encoded,
either way.
"""

from __future__ import annotations

import queue
import threading
from typing import Protocol


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
        # Messages put, taken and applied. The worker polls again only once it has
        # acted on what it took, so a poll marks everything taken as applied.
        self._sent = self._taken = self._applied = 0
        self._changed = threading.Condition()

    # --- the worker's end (ControlChannel) ---
    def send_bytes(self, data: bytes) -> None:
        self._outbox.put(bytes(data))

    def recv_bytes(self) -> bytes:
        data = self._inbox.get()
        self._taken += 1
        return data

    def poll(self) -> bool:
        if self._applied != self._taken:
            with self._changed:
                self._applied = self._taken
                self._changed.notify_all()
        return not self._inbox.empty()  # only the worker thread reads: no race to lose

    # --- the launcher's end ---
    def to_worker(self, data: bytes, wait_s: float = 0.0) -> bool:
        """Queue a message; with wait_s, wait until the worker has acted on it (e.g. its
        new peers are connected). False if it has not within wait_s seconds."""
        with self._changed:
            self._sent += 1
            number = self._sent
        self._inbox.put(data)
        if not wait_s:
            return True
        with self._changed:
            return self._changed.wait_for(lambda: self._applied >= number, wait_s)

    def from_worker(self, timeout: float) -> bytes | None:
        """The worker's next message, or None if none came within `timeout` seconds."""
        try:
            return self._outbox.get(timeout=timeout)
        except queue.Empty:
            return None
