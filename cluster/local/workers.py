"""Start a cluster config's workers as processes on this machine, and stop them."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_any
from typing import TYPE_CHECKING, TypeVar, cast

from cluster import console
from cluster.config import ClusterConfig
from cluster.local.fork_server import ForkedProcess, in_environment, worker_context
from cluster.local.kv_store import StoreProcess, start_store
from cluster.peers import peers_messages
from cluster.worker_configs import serve_worker, worker_config
from engine.distributed.shm_files import sweep_orphans
from kv_transfer.shm_segments import unlink_segment
from protocol import CONTROL_MESSAGES, Ready, Serving, Stop, encode
from security import DeploymentSecret

if TYPE_CHECKING:
    from cluster.local.supervisor import LocalSupervisor

logger = logging.getLogger(__name__)
_Message = TypeVar("_Message", Ready, Serving)


@dataclass
class Worker:
    name: str
    process: ForkedProcess  # forked by the fork server (cluster/local/fork_server.py)
    control: Connection
    address: str = ""
    metadata: bytes = b""
    started: float = field(default_factory=time.monotonic)  # when its process was started
    draining: bool = False  # being scaled down (cluster/elastic.py)

    @property
    def role(self) -> str:
        return self.name.rpartition("-")[0]

    @property
    def index(self) -> int:
        return int(self.name.rpartition("-")[2])


@dataclass
class LocalWorkers:
    decode: list[Worker] = field(default_factory=list)
    prefill: list[Worker] = field(default_factory=list)
    supervisor: LocalSupervisor | None = None  # set by LocalLauncher.supervise
    # The deployment's (start_workers makes it): every worker has it, restarted ones
    # too, and the router gets it from here (cluster/serve.py).
    secret: DeploymentSecret | None = field(default=None, repr=False)
    # Down (being restarted by the supervisor, or for good): told to nobody as a peer.
    gone: set[str] = field(default_factory=set)
    # Held while the pools change or a Peers message is made and sent: the supervisor's
    # restarts and the elastic scaler's adds and removals (cluster/local/elastic.py).
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    # The next index of each pool's workers: a worker added at runtime never takes the
    # name of one that left (the router and /metrics know workers by name).
    indexes: dict[str, int] = field(default_factory=dict)
    # Workers LocalPools is adding, in no pool until they serve: a shutdown stops them
    # too. Once `stopped`, none is added (cluster/local/elastic.py checks under the lock).
    starting: list[Worker] = field(default_factory=list)
    stopped: bool = False
    # The shared KV store (kv_store.enabled), stopped after the workers; the supervisor
    # replaces one that died by a new one at the same address (under the lock).
    store: StoreProcess | None = None

    @property
    def store_address(self) -> str | None:
        return self.store.address if self.store is not None else None

    def next_index(self, role: str) -> int:
        pool = self.decode if role == "decode" else self.prefill
        index = max([self.indexes.get(role, 0), *(w.index + 1 for w in pool)])
        self.indexes[role] = index + 1
        return index

    @property
    def all(self) -> list[Worker]:
        return self.decode + self.prefill

    def live(self, pool: list[Worker]) -> list[Worker]:
        return [w for w in pool if w.name not in self.gone and w.process.is_alive()]

    def peers_messages(self) -> tuple[bytes, bytes]:
        """The Peers message for a decode and for a prefill worker: the live workers of
        the other pool (call with the lock held)."""
        return peers_messages(self.live(self.decode), self.live(self.prefill))

    def tell_peers(self, roles: tuple[str, ...] = ("decode", "prefill")) -> None:
        """Every live worker of `roles` gets the live workers of the other pool."""
        with self.lock:
            to_decode, to_prefill = self.peers_messages()
            targets = [(w, to_decode) for w in self.live(self.decode) if "decode" in roles]
            targets += [(w, to_prefill) for w in self.live(self.prefill) if "prefill" in roles]
            for w, message in targets:
                try:
                    w.control.send_bytes(message)
                except (BrokenPipeError, OSError):
                    pass  # it died too: the supervisor handles it

    def stop_supervising(self, timeout: float = 10.0) -> None:
        """From now on no exit is taken for a crash, nor restarted: the first thing a
        shutdown does (a signal to the process group may be killing the workers now)."""
        if self.supervisor is not None:
            self.supervisor.stop(timeout)
            self.supervisor = None

    def stop(self, timeout: float = 10.0) -> None:
        with self.lock:
            self.stopped = True
            starting = list(self.starting)
        self.stop_supervising(timeout)  # first: a worker stopped now is not restarted
        stop_processes(self.all + starting, timeout)
        with self.lock:  # after the supervisor stopped: a store it restarted is here, or it stopped it
            store = self.store
        if store is not None:
            store.stop(timeout)


def stop_processes(workers: list[Worker], timeout: float = 10.0) -> None:
    """Ask each to stop, wait, kill those that do not, and remove what they held."""
    for w in workers:
        try:
            w.control.send_bytes(encode(Stop()))
        except (BrokenPipeError, OSError):
            pass
    for w in workers:
        w.process.join(timeout)
        if w.process.is_alive():
            w.process.kill()
            w.process.join(timeout)
        if w.metadata:  # a worker that was killed could not remove its shared memory
            unlink_segment(w.metadata)
    sweep_orphans()  # rank caches of a TP worker killed before it said ready


def spawn(config: ClusterConfig, role: str, index: int, secret: DeploymentSecret | None,
          kv_store: str | None = None) -> Worker:
    """Start worker `index` of `role` ("decode" or "prefill") as a process, forked by the
    fork server. `secret` reaches it in its WorkerConfig, pickled into the process's
    arguments (a pipe to the child, never its argv, environment or a file); kv_store:
    the shared KV store's address, if the deployment has one."""
    ctx = worker_context()
    parent, child = ctx.Pipe()
    worker = worker_config(config, role, index, secret=secret, kv_store=kv_store)
    process = ctx.Process(target=in_environment, args=(dict(os.environ), serve_worker, worker, child),
                          name=f"pdserve-{role}-{index}", daemon=True)
    started = time.monotonic()
    process.start()
    console.worker_starting(worker.name, worker.engine)
    return Worker(worker.name, ForkedProcess(process), parent, started=started)


def await_ready(w: Worker, timeout: float) -> None:
    """Wait for the worker's "ready" (its ZMQ address and transport metadata)."""
    if not w.control.poll(timeout):
        raise _not_ready(w, timeout)
    ready = _expect(w, Ready)
    w.address, w.metadata = ready.address, ready.metadata


def await_all_ready(workers: list[Worker], timeout: float) -> None:
    """await_ready for each, taken as each comes (workers load side by side), so that
    its line says when it was ready."""
    end = time.monotonic() + timeout
    waiting = {w.control: w for w in workers}
    while waiting:
        arrived = wait_for_any(list(waiting), max(0.0, end - time.monotonic()))
        if not arrived:
            raise _not_ready(next(iter(waiting.values())), timeout)
        for control in arrived:
            w = waiting.pop(cast(Connection, control))  # wait() returns the objects it was given
            await_ready(w, 0.0)
            console.worker_ready(w.name, w.address, time.monotonic() - w.started)


def _not_ready(w: Worker, timeout: float) -> RuntimeError:
    alive = "still starting" if w.process.is_alive() else f"exited with {w.process.exitcode}"
    return RuntimeError(f"worker {w.name} did not become ready within {timeout} s ({alive})")


def await_serving(w: Worker, timeout: float) -> None:
    """Wait for the worker's "serving": it applied its first peers (handshakes made)."""
    if not w.control.poll(timeout):
        raise RuntimeError(f"worker {w.name} did not take its peers within {timeout} s")
    serving = _expect(w, Serving)
    if serving.cold:
        logger.warning("%s has no KV handshake with %s: their prompts are prefilled locally",
                       w.name, ", ".join(serving.cold))


def _expect(w: Worker, kind: type[_Message]) -> _Message:
    try:
        data = w.control.recv_bytes()
    except EOFError:  # it died starting: its own log above says why
        w.process.join(5)
        raise RuntimeError(f"worker {w.name} exited with {w.process.exitcode} before it was "
                           f"{kind.__name__.lower()} (its error is logged above)") from None
    message = CONTROL_MESSAGES.decode(data)
    if not isinstance(message, kind):
        raise RuntimeError(f"worker {w.name} sent {type(message).__name__}, expected {kind.__name__}")
    return message


def start_workers(config: ClusterConfig, timeout: float = 180.0) -> LocalWorkers:
    """Make the deployment's secret, spawn every worker with it, wait until each reports
    ready, then tell each its peers: decode workers get the prefill workers' addresses,
    prefill workers the decode workers' transport metadata; wait until each reports
    serving (its handshakes made). With kv_store.enabled the shared KV store starts
    first. Raises (after stopping what started) if any fails."""
    secret = DeploymentSecret.new()
    store = start_store(config, secret) if config.kv_store.enabled else None
    address = store.address if store is not None else None
    try:
        workers = LocalWorkers(
            decode=[spawn(config, "decode", i, secret, address) for i in range(config.decode.replicas)],
            prefill=[spawn(config, "prefill", i, secret, address) for i in range(config.prefill.replicas)],
            secret=secret, indexes={"decode": config.decode.replicas, "prefill": config.prefill.replicas},
            store=store)
    except BaseException:
        if store is not None:
            store.stop()
        raise
    try:
        await_all_ready(workers.all, timeout)
        to_decode, to_prefill = peers_messages(workers.decode, workers.prefill)
        for w in workers.decode:  # first: the prefill workers' handshakes need them polling
            w.control.send_bytes(to_decode)
        for w in workers.prefill:
            w.control.send_bytes(to_prefill)
        for w in workers.all:  # pre-warmed: every KV handshake is made before the router starts
            await_serving(w, timeout)
    except BaseException:
        workers.stop()
        raise
    return workers
