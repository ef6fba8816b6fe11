"""One pdserve worker inside a Ray actor: the same `serve(config, index, control)` the
local launcher runs in a process, here in a thread of the actor process.

The class is plain Python (no Ray import) so it runs in tests without Ray; the launcher wraps it with `ray.remote(WorkerActor)` and
creates it with max_concurrency > 1, because `ready()` blocks in one of Ray's threads
while the worker starts in another. Who calls what: the launcher calls `ready()` once,
then `peers()`, then `stop()`; its supervisor (cluster/supervisor.py) calls
`incarnation()` every interval, `peers()` again when a peer dies or comes back, and,
after Ray restarted the actor (a new incarnation), `ready()` and `peers()` as at the
start. Nothing else talks to the actor (requests and KV go over ZMQ and the transport).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
import uuid

from cluster.config import ClusterConfig
from cluster.control import STOP, QueueControl
from router.protocol import decode

logger = logging.getLogger(__name__)

ROLES = ("decode", "prefill")


class WorkerActor:
    def __init__(self, role: str, config: ClusterConfig, index: int, host: str) -> None:
        """`host`: where the worker's sockets listen (this node's address)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.name = f"{role}-{index}"
        # Ray reruns __init__ in a new process when it restarts the actor: the
        # supervisor tells a restart by this changing.
        self._incarnation = uuid.uuid4().hex
        self.control = QueueControl()
        self._serving = False  # the first peers message was taken and answered
        self.error = ""  # the worker thread's traceback, if serve() raised
        self.thread = threading.Thread(target=self._run, args=(role, config, index, host),
                                       name=f"pdserve-{self.name}", daemon=True)
        self.thread.start()

    def _run(self, role: str, config: ClusterConfig, index: int, host: str) -> None:
        # Imported here: the entry points load torch and the engine, which only the
        # worker thread needs.
        if role == "decode":
            from decode_worker.server import serve
        else:
            from prefill_worker.server import serve
        try:
            serve(config, index, self.control, host)
        except BaseException:  # kept for ready(), and logged: Ray forwards actor logs to the driver
            self.error = traceback.format_exc()
            logger.error("worker %s failed:\n%s", self.name, self.error)
            if self._serving:
                # A crash while serving: end the process, so that Ray restarts the actor
                # (bounded by ray.max_restarts) and the supervisor wires it back in. A
                # failed start is reported by ready() instead.
                os._exit(1)

    def ready(self, timeout: float) -> bytes:
        """The worker's "ready" message (msgpack, router/protocol.py). Raises if the
        worker failed or took longer than `timeout` seconds."""
        return self._from_worker("become ready", timeout)

    def _from_worker(self, what: str, timeout: float) -> bytes:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            message = self.control.from_worker(0.1)
            if message is not None:
                return message
            if not self.thread.is_alive():
                raise RuntimeError(f"worker {self.name} failed while starting:\n{self.error}")
        raise TimeoutError(f"worker {self.name} did not {what} within {timeout} s")

    def incarnation(self) -> str:
        """This process's id; a health check. Raises if the worker thread died (so the
        supervisor counts a worker whose loop crashed as dead, too)."""
        if not self.thread.is_alive() and self.error:
            raise RuntimeError(f"worker {self.name} failed:\n{self.error}")
        return self._incarnation

    def pid(self) -> int:
        return os.getpid()

    def peers(self, message: bytes, wait_s: float = 30.0) -> bool:
        """Hand the worker a "peers" message; True once it has acted on it (connected
        to new peers and made their KV handshakes, dropped gone ones). The first one
        starts it serving: it answers "serving" (pre-warmed), read here."""
        if self._serving:
            return self.control.to_worker(message, wait_s)
        self.control.to_worker(message)
        serving = decode(self._from_worker("take its peers", wait_s))
        if serving["cold"]:
            logger.warning("%s has no KV handshake with %s: their prompts are prefilled locally",
                           self.name, ", ".join(serving["cold"]))
        self._serving = True
        return True

    def stop(self, timeout: float) -> bool:
        """Stop the worker loop (it closes its sockets and transport); True once it has."""
        self.control.to_worker(STOP)
        self.thread.join(timeout)
        return not self.thread.is_alive()
