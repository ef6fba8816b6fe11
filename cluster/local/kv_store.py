"""The deployment's shared KV store (kv_store/), as a process the local launcher starts
before the workers (they are given its address) and stops after them. The supervisor
starts a store that died again where it listened (restart_store): the workers keep its
address, and their clients reconnect on their own (cluster/local/supervisor.py)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from cluster.config import ClusterConfig
from cluster.local.fork_server import ForkedProcess, in_environment, worker_context
from kv_store.process import serve_store
from security import DeploymentSecret

START_TIMEOUT_S = 30.0
# How long a store started on a given port (a restart) tries again while that port is in
# use (kv_store/process.py bind_store): well within START_TIMEOUT_S, and short enough
# that the supervisor's next try comes soon.
BIND_TIMEOUT_S = 5.0


@dataclass
class StoreProcess:
    process: ForkedProcess
    control: Connection
    address: str  # tcp://host:port
    started: float = field(default_factory=time.monotonic)  # when its process was started

    @property
    def host(self) -> str:
        return self.address.removeprefix("tcp://").rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    def stop(self, timeout: float = 10.0) -> None:
        try:
            self.control.send("stop")
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)
        self.control.close()


def start_store(config: ClusterConfig, secret: DeploymentSecret | None, host: str = "127.0.0.1", port: int = 0,
                bind_timeout_s: float = BIND_TIMEOUT_S) -> StoreProcess:
    """Start the store and wait for its address (RuntimeError if it does not come).
    port 0: any free one; a given port is tried again for bind_timeout_s while in use."""
    ctx = worker_context()
    parent, child = ctx.Pipe()
    capacity = int(config.kv_store.capacity_gib * 2**30)
    started = time.monotonic()
    process = ctx.Process(target=in_environment,
                          args=(dict(os.environ), serve_store, capacity, host, secret, child, port, bind_timeout_s),
                          name="pdserve-kv-store", daemon=True)
    process.start()
    child.close()  # the child's end is the child's alone: its exit is then EOF here, at once
    forked = ForkedProcess(process)
    if not parent.poll(START_TIMEOUT_S):
        forked.kill()
        parent.close()
        raise RuntimeError(f"the KV store did not start in {START_TIMEOUT_S:g} s")
    try:
        address = parent.recv()
    except EOFError:
        forked.join(5)
        parent.close()
        raise RuntimeError(f"the KV store exited as it started (exit code {forked.exitcode}; "
                           "its error is logged above)") from None
    return StoreProcess(forked, parent, address, started)


def restart_store(dead: StoreProcess, config: ClusterConfig, secret: DeploymentSecret | None) -> StoreProcess:
    """A new store where `dead` listened, with the config's capacity and the deployment's
    secret: every worker's client, which keeps that address, reconnects to it and finds
    a new store id (its directory copy starts over; the old blocks are lost)."""
    dead.stop(0)  # closes its control pipe (it exited: nothing to wait for)
    return start_store(config, secret, dead.host, dead.port, BIND_TIMEOUT_S)
