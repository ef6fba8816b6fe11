"""The deployment's shared KV store (kv_store/) as a Ray actor: the Ray launcher's
counterpart of the local launcher's store process (cluster/local/kv_store.py), started
before the workers (each is given its address) and killed after them.

`StoreActor` is plain Python (Ray is imported only to look up the node's address) so it
runs in tests without Ray; `start_store` wraps it with `ray.remote(StoreActor)`.

Restarts: Ray restarts a crashed store actor (up to `ray.max_restarts`) by running its
constructor again, with the same arguments, in a new process. The workers hold the
store's address in their own constructor arguments (which Ray keeps for their restarts
too), so a restarted store must listen where the first one did. Hence the address is
fixed before the actor exists: the actor is pinned to the launcher's node
(NodeAffinitySchedulingStrategy, soft=False) and given a port the launcher found free
there. The workers' StoreClients reconnect on their own (ZMQ) and tell the new store
by its id (its directory starts empty): the blocks the old one held are lost, which
costs the workers only the time to compute them. A restart that cannot bind the port
(taken meanwhile) ends the actor for good, and the workers compute from then on.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from cluster.ray.actor import node_address
from kv_store.server import StoreServer
from security import DeploymentSecret

if TYPE_CHECKING:
    from cluster.config import ClusterConfig

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # a new actor process (Python, Ray's worker); no model to load
START_ATTEMPTS = 3  # a port found free may be taken before the actor binds it: pick another


class StoreActor:
    """Who calls what: the launcher calls address() once after creating it (and tests
    pid()), and stop() before it kills the actor. Nothing else talks to the actor: the
    workers reach the store over its own CURVE socket."""

    def __init__(self, capacity_bytes: int, port: int, host: str | None = None, *,
                 secret: DeploymentSecret | None) -> None:
        """`port`: where to listen (0: any free one; the launcher fixes it, so that a
        restart listens there again); `host`: None: this node's address as Ray knows it;
        `secret`: the deployment's (a constructor argument, so that a restarted store has
        it too; never the router's secrets)."""
        self._server = StoreServer(capacity_bytes, host or node_address(), port, secret=secret).start()
        logger.info("KV store serving at %s, %.2f GiB", self._server.address, capacity_bytes / 2**30)

    def address(self) -> str:
        return self._server.address

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self._server.stop()


def free_port(host: str) -> int:
    """A TCP port free on `host` now (on this node: the store is pinned here)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_store(config: ClusterConfig, secret: DeploymentSecret | None) -> tuple[Any, str]:
    """Create the store actor on this node and wait until it serves: (its handle, its
    address). Raises RuntimeError (nothing left behind) if it does not start."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node, host = ray.get_runtime_context().get_node_id(), node_address()
    capacity = int(config.kv_store.capacity_gib * 2**30)
    error = ""
    for _ in range(START_ATTEMPTS):
        actor: Any = ray.remote(StoreActor).options(
            # Its one thread mostly waits on its socket: it takes no CPU from the pools'
            # placement groups (check_capacity counts only theirs).
            num_cpus=0, max_restarts=config.ray.max_restarts, max_task_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(capacity, free_port(host), host, secret=secret)
        try:
            address: str = ray.get(actor.address.remote(), timeout=START_TIMEOUT_S)
            return actor, address
        except (ray.exceptions.RayError, TimeoutError) as exc:
            ray.kill(actor, no_restart=True)
            error = str(exc)
            if "Address already in use" not in error:
                break
    raise RuntimeError(f"the KV store did not start: {error}")


def stop_store(actor: Any, timeout: float) -> None:
    """Close its socket, then end the actor for good (even if it did not answer)."""
    import ray

    ray.wait([actor.stop.remote()], timeout=timeout)
    ray.kill(actor, no_restart=True)
