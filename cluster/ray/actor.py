"""One pdserve worker inside a Ray actor: the same `serve(config, control)` the local
launcher runs in a process, here in a thread of the actor process.

The class is plain Python (Ray is imported only to look up the node's address) so it
runs in tests without Ray; the launcher wraps it with `ray.remote(WorkerActor)` and
creates it with max_concurrency > 1, because `ready()` blocks in one of Ray's threads
while the worker starts in another. Who calls what: the launcher calls `incarnation()`,
`ready()`, then `start_serving()` once each, and `stop()` at the end; the supervisor
(cluster/ray/supervisor.py) calls `incarnation()` every interval, `peers()` when a peer
dies or comes back, and, after Ray restarted the actor (a new incarnation),
`ready()` and `start_serving()` as at the start. Nothing else talks to the actor
(requests and KV go over ZMQ and the transport).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
import uuid

from cluster.config import ClusterConfig
from cluster.worker_configs import serve_worker, worker_config
from protocol import CONTROL_MESSAGES, Serving, Stop, encode
from security import DeploymentSecret
from workers.config import ROLES, WorkerConfig
from workers.control import QueueControl

logger = logging.getLogger(__name__)


class WorkerActor:
    def __init__(self, role: str, config: ClusterConfig, index: int, host: str | None = None, *,
                 secret: DeploymentSecret | None, kv_store: str | None = None) -> None:
        """`secret`: the deployment's (a constructor argument, so that the process Ray
        restarts the actor in gets the same one); `host`: where the worker's sockets
        listen; None: this node's address as Ray knows it (looked up here, because a
        restart may land on another node); `kv_store`: the shared KV store's address
        (cluster/ray/kv_store.py: a restarted store listens there again)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.name = f"{role}-{index}"
        # Ray reruns __init__ in a new process when it restarts the actor: the
        # supervisor tells a restart by this changing.
        self._incarnation = uuid.uuid4().hex
        self.control = QueueControl()
        self._serving = False  # the first peers message was taken and answered
        self.error = ""  # the worker thread's traceback, if serve() raised
        worker = worker_config(config, role, index, host or node_address(), secret=secret, kv_store=kv_store)
        self.thread = threading.Thread(target=self._run, args=(worker,), name=f"pdserve-{self.name}", daemon=True)
        self.thread.start()

    def _run(self, config: WorkerConfig) -> None:
        try:
            serve_worker(config, self.control)
        except BaseException:  # kept for ready(), and logged: Ray forwards actor logs to the driver
            self.error = traceback.format_exc()
            logger.error("worker %s failed:\n%s", self.name, self.error)
            if self._serving:
                # A crash while serving: end the process, so that Ray restarts the actor
                # (bounded by ray.max_restarts) and the supervisor wires it back in. A
                # failed start is reported by ready() instead.
                os._exit(1)

    def ready(self, timeout: float) -> bytes:
        """The worker's Ready message, encoded (protocol/control.py). Raises if the
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

    def start_serving(self, message: bytes, incarnation: str, wait_s: float = 60.0) -> list[str]:
        """Hand the worker its first Peers message, after ready(); returns once it
        serves, with every KV handshake made (pre-warmed): the peers whose handshake
        failed. `incarnation` must be this process's: a call meant for the actor
        before a restart must not be taken as this one's start."""
        self._check(incarnation, serving=False)
        self.control.to_worker(message)
        serving = CONTROL_MESSAGES.decode(self._from_worker("take its peers", wait_s))
        if not isinstance(serving, Serving):
            raise RuntimeError(f"{self.name} sent {type(serving).__name__} where Serving was due")
        self._serving = True
        return serving.cold

    def peers(self, message: bytes, incarnation: str, wait_s: float = 30.0) -> bool:
        """A later Peers message (a peer died or came back); True once the worker has
        acted on it (connected to new peers and made their handshakes, dropped gone
        ones)."""
        self._check(incarnation, serving=True)
        return self.control.to_worker(message, wait_s)

    def _check(self, incarnation: str, serving: bool) -> None:
        if incarnation != self._incarnation:
            raise RuntimeError(f"{self.name}: a call for incarnation {incarnation}, this is {self._incarnation} "
                               "(restarted meanwhile)")
        if self._serving != serving:
            raise RuntimeError(f"{self.name} is {'already' if self._serving else 'not yet'} serving")

    def stop(self, timeout: float) -> bool:
        """Stop the worker loop (it closes its sockets and transport); True once it has."""
        self.control.to_worker(encode(Stop()))
        self.thread.join(timeout)
        return not self.thread.is_alive()


def node_address() -> str:
    """The address Ray registered this node under (what other nodes reach it at)."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node)
