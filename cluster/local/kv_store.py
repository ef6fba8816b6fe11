"""The deployment's shared KV store (kv_store/), as a process the local launcher starts
before the workers (they are given its address) and stops after them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from multiprocessing.connection import Connection

from cluster.config import ClusterConfig
from cluster.local.fork_server import ForkedProcess, in_environment, worker_context
from kv_store.process import serve_store
from security import DeploymentSecret

START_TIMEOUT_S = 30.0


@dataclass
class StoreProcess:
    process: ForkedProcess
    control: Connection
    address: str

    def stop(self, timeout: float = 10.0) -> None:
        try:
            self.control.send("stop")
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)


def start_store(config: ClusterConfig, secret: DeploymentSecret | None, host: str = "127.0.0.1") -> StoreProcess:
    """Start the store and wait for its address (RuntimeError if it does not come)."""
    ctx = worker_context()
    parent, child = ctx.Pipe()
    capacity = int(config.kv_store.capacity_gib * 2**30)
    process = ctx.Process(target=in_environment, args=(dict(os.environ), serve_store, capacity, host, secret, child),
                          name="pdserve-kv-store", daemon=True)
    process.start()
    child.close()  # the child's end is the child's alone: its exit is then EOF here, at once
    forked = ForkedProcess(process)
    if not parent.poll(START_TIMEOUT_S):
        forked.kill()
        raise RuntimeError(f"the KV store did not start in {START_TIMEOUT_S:g} s")
    try:
        address = parent.recv()
    except EOFError:
        forked.join(5)
        raise RuntimeError(f"the KV store exited as it started (exit code {forked.exitcode})") from None
    return StoreProcess(forked, parent, address)
