"""The local launcher's pools, grown and shrunk at runtime (cluster/elastic.py's
PoolBackend): a worker process added under a new name, by the path a restarted one
takes (ready, its peers, serving, then the other pool learns it); one removed is
taken out of its pool first (so neither the supervisor nor a Peers message counts it
any more), then the other pool is told and it is stopped, its shared memory removed (a
prefill worker is stopped first: remove_worker says why). A shutdown (LocalWorkers.stop) stops a worker still starting too, and none is
added after it."""

from __future__ import annotations

import time

from cluster import console
from cluster.config import ClusterConfig
from cluster.local.workers import LocalWorkers, Worker, await_ready, await_serving, spawn, stop_processes


class LocalPools:
    def __init__(self, config: ClusterConfig, workers: LocalWorkers, start_timeout_s: float = 180.0) -> None:
        self.config = config
        self.workers = workers
        self.start_timeout_s = start_timeout_s

    def pool(self, role: str) -> list[Worker]:
        return self.workers.decode if role == "decode" else self.workers.prefill

    def add_worker(self, role: str) -> Worker:
        """Start one more worker of `role` and return it once it serves and the other
        pool knows it; raises RuntimeError (nothing left behind) if it cannot start."""
        with self.workers.lock:  # its name: never one the deployment used before
            self._check_running(role)
            index = self.workers.next_index(role)
        new = spawn(self.config, role, index, self.workers.secret, self.workers.store_address)
        try:
            with self.workers.lock:  # from now on a shutdown stops it too
                self.workers.starting.append(new)
                self._check_running(role)
            await_ready(new, self.start_timeout_s)
            with self.workers.lock:
                to_decode, to_prefill = self.workers.peers_messages()
                new.control.send_bytes(to_decode if role == "decode" else to_prefill)
            await_serving(new, self.start_timeout_s)
            with self.workers.lock:
                self._check_running(role)
                self._unlist(new)
                self.pool(role).append(new)
        except BaseException as exc:
            with self.workers.lock:
                self._unlist(new)
            stop_processes([new])
            if self.workers.stopped and isinstance(exc, Exception):  # its pipe broke because of that
                raise RuntimeError(f"the deployment stopped while {new.name} started") from exc
            raise
        # Both pools: the other learns it, and it learns any change to the other (a
        # restart) made since its first peers, which a restart's tell_peers missed.
        self.workers.tell_peers()
        console.worker_ready(new.name, new.address, time.monotonic() - new.started)
        return new

    def set_draining(self, name: str) -> None:
        """A draining prefill worker gets no new prompt from the decode workers (told
        now); a draining decode worker is the router's business only."""
        with self.workers.lock:
            worker = self._find(name)
            worker.draining = True
        if worker.role == "prefill":
            self.workers.tell_peers(("decode",))

    def remove_worker(self, name: str, timeout: float = 10.0) -> None:
        """Out of its pool (the supervisor no longer watches it), the other pool told
        and it stopped: a decode worker is stopped after its prefill workers drop it as
        a KV destination (their jobs for it end); a prefill worker before its decode
        workers learn it is gone, for they then release the blocks it was writing and
        prefill those prompts locally in them, which only a sender that has exited
        cannot write into any more (as after a crash)."""
        with self.workers.lock:
            worker = self._find(name)
            self.pool(worker.role).remove(worker)
            self.workers.gone.discard(name)
        if worker.role == "prefill":
            stop_processes([worker], timeout)
        self.workers.tell_peers(("prefill",) if worker.role == "decode" else ("decode",))
        if worker.role == "decode":
            stop_processes([worker], timeout)

    def _check_running(self, role: str) -> None:
        """RuntimeError once the deployment stops (call with the lock held): a worker
        added then would be in no pool its shutdown stops."""
        if self.workers.stopped:
            raise RuntimeError(f"the deployment is stopping: no {role} worker is added")

    def _unlist(self, new: Worker) -> None:
        self.workers.starting[:] = [w for w in self.workers.starting if w is not new]

    def _find(self, name: str) -> Worker:
        for w in self.workers.all:
            if w.name == name:
                return w
        raise LookupError(f"no worker named {name} in the deployment")
