"""Helpers to run a transport agent in a child process (tests/kv_transfer/agent.py)."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from cluster.local.fork_server import PRELOAD
from kv_transfer import KVTransport
from kv_transfer.shm_segments import unlink_segment
from tests.kv_transfer.agent import run_agent, secret_of

# Agents start from a fork server that has imported torch and the transports once: a
# spawned agent would import them again (2.2-2.4 CPU-seconds each here; with the fork
# server test_transports took 52 s of test time instead of 232). The server is its own
# fresh process (not a fork of pytest's, which may hold threads), and forks each agent
# before the agent makes any thread. It is this process's only fork server, which also
# forks the local launcher's workers (cluster/local/fork_server.py): it preloads theirs too.
_AGENTS = mp.get_context("forkserver")
_AGENTS.set_forkserver_preload([*PRELOAD, "kv_transfer", "tests.kv_transfer.agent"])


class RemoteAgent:
    """The child process side. While waiting for its replies the test keeps polling its
    own transport (`local`), since the child may be waiting for our acknowledgements.
    A Secured transport name gives the child the deployment secret."""

    def __init__(self, transport: str, name: str, seed: int, local: KVTransport | None = None,
                 timeout_s: float = 5.0, grace_s: float = 5.0, block_size: int = 16,
                 dtype: str = "float32") -> None:
        self.conn, child = _AGENTS.Pipe()
        secret = secret_of(transport)
        self.process = _AGENTS.Process(target=run_agent, daemon=True,
                                   args=(child, str(transport), name, seed, timeout_s, grace_s, block_size, dtype,
                                         secret.hex if secret is not None else None))
        self.process.start()
        self.local = local
        self.local_events: list[Any] = []
        if not self.conn.poll(60):
            raise TimeoutError(f"agent {name} did not start within 60 s")
        self.metadata = self.conn.recv_bytes()

    def call(self, op: str, timeout: float = 30.0, poll_local: bool = True, **args: Any) -> dict[str, Any]:
        """poll_local=False: the local side stays still meanwhile (to order events)."""
        self.conn.send_bytes(msgpack.packb({"op": op, **args}, use_bin_type=True))
        end = time.monotonic() + timeout
        while not self.conn.poll(0.002):
            if self.local is not None and poll_local:
                self.local_events += self.local.poll()
            if time.monotonic() > end or not self.process.is_alive():
                raise TimeoutError(f"agent did not answer {op!r} (alive: {self.process.is_alive()})")
        reply = msgpack.unpackb(self.conn.recv_bytes(), raw=False)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)
        unlink_segment(self.metadata)  # it cannot remove its shared memory itself

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send_bytes(msgpack.packb({"op": "exit"}))
                self.process.join(10)
            except (BrokenPipeError, OSError):
                pass
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        unlink_segment(self.metadata)


@pytest.fixture
def agents() -> Iterator[list[RemoteAgent]]:
    """Every RemoteAgent appended here is stopped (killed if need be) after the test."""
    started: list[RemoteAgent] = []
    yield started
    for a in started:
        a.stop()
