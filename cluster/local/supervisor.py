"""Supervision of the local launcher's worker processes (cluster/ray/supervisor.py does the
same on Ray, where Ray restarts the process).

Every `interval_s` the thread looks for a worker process that has exited: killed, or
given up on its own (an error it cannot recover from, a stall, a hung step: it exits
with status 1 after telling its clients, workers/loop.py). A process the router has
declared dead for its silence (router.worker_timeout_s) while it still runs (stopped,
wedged) is killed first, as the Ray supervisor kills an actor that does not answer.
For each that exited:

- down: the router is told at once (a decode worker's requests fail over without
  waiting for its health timeout), its shared-memory segment is removed, and the other
  pool gets peers without it: decode workers prefill locally the prompts a dead
  prefill worker was computing (no waiting for the KV deadline), prefill workers end
  their jobs for a dead decode worker.
- A worker that died of SIGTERM is taken for down only once SIGTERM_GRACE_S passed
  without the launcher stopping: a signal to the whole process group is a shutdown.
  So is one whose exit status nobody knows (it exited after its fork server died).
- restarted, in a thread of its own (other deaths are reported meanwhile), up to
  `max_restarts` starts per worker (the config's `local.max_restarts`): a new process
  under the same name gets its peers and starts serving (its handshakes made), then
  the other pool learns it, and last the router, so no request reaches it before its peers know it. A start that fails
  is stopped (its shared memory removed) and tried again; past `max_restarts` the
  worker stays down (the router's /health says so once no decode worker is left).

The shared KV store's process (kv_store.enabled) is watched in the same sweep, SIGTERM
grace included. One that exited is started again, in a thread of its own (a port still
held is waited for a few seconds), at the same address, with the same capacity and the
deployment's secret: the workers keep that address, their clients reconnect on their
own (ZMQ) and see the new store's id, so their directory copies start over (the old
store's blocks are lost: time, never a request). A start that fails is tried again on
a later sweep; past `max_restarts` starts in all the store stays down and the workers
compute what they would have loaded, as on Ray (cluster/ray/kv_store.py).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable

from cluster import console
from cluster.config import ClusterConfig
from cluster.local.fork_server import ForkedProcess
from cluster.local.kv_store import StoreProcess, restart_store
from cluster.local.workers import LocalWorkers, Worker, await_ready, await_serving, spawn, stop_processes
from engine.distributed.shm_files import sweep_orphans
from kv_transfer.shm_segments import unlink_segment

logger = logging.getLogger(__name__)

# A worker killed by SIGTERM may have got it with the launcher: `timeout`, `kill -TERM
# -PGID` and systemd signal the whole process group at once, and the workers, unlike
# the launcher, do not catch it. This long, the watch waits for the launcher's own
# shutdown to begin before taking such a death for a crash (and restarting it).
SIGTERM_GRACE_S = 2.0
STORE = "kv-store"  # the store's key in `restarts`, and its name in the console's lines


class LocalSupervisor:
    def __init__(self, config: ClusterConfig, workers: LocalWorkers, down: Callable[[str], None],
                 moved: Callable[[str, str], None], interval_s: float = 0.5, max_restarts: int = 3,
                 start_timeout_s: float = 180.0, silent: Callable[[], set[str]] = set,
                 stays_down: Callable[[str, str], None] = lambda name, why: None) -> None:
        """down(name) and moved(name, new ZMQ address): what the router is told
        (RouterControl.worker_down / worker_moved), from this supervisor's threads.
        silent(): the workers the router declared dead for their silence
        (RouterControl.silent): such a process is killed. stays_down(name, why): one
        past max_restarts (RouterControl.worker_stays_down)."""
        self.config = config
        self.workers = workers
        self.down, self.moved, self.silent, self.stays_down = down, moved, silent, stays_down
        self.interval_s = interval_s
        self.max_restarts = max_restarts
        self.start_timeout_s = start_timeout_s
        self.restarts: Counter[str] = Counter()
        self.gone = workers.gone  # down: being restarted, or for good
        # Peers messages and pool updates come from the watch thread, restarts and the
        # elastic scaler: one lock, the workers'.
        self._lock = workers.lock
        self._starting: dict[str, Worker] = {}  # restarted processes not yet serving
        self._stop = threading.Event()
        self._sigterm_seen: dict[int, float] = {}  # id(process) -> when its SIGTERM death was seen
        self._store_restart: threading.Thread | None = None  # the store's start in flight, if any
        self._store_seen_dead: StoreProcess | None = None  # the dead store already reported
        self._store_down = False  # past max_restarts: stays down
        self._thread = threading.Thread(target=self._run, name="local-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Before the workers are stopped: a worker that exits then is not restarted,
        and one still starting is stopped here (the launcher does not know it yet); a
        store still starting is waited for, and stops itself (_restart_store)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        restart = self._store_restart
        if restart is not None:
            restart.join(timeout)
        with self._lock:
            starting = list(self._starting.values())
        stop_processes(starting)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:  # a scale-down removes workers meanwhile
                watched = self.workers.all
            hung = self._hung()
            for w in watched:
                if w.name in self.gone or self._stop.is_set() or not self._member(w):
                    continue
                if w.process.is_alive():
                    if w.name in hung:
                        self._kill_hung(w)
                    continue
                if not self._crashed(w.process):
                    continue  # maybe the deployment is stopping: not a crash yet
                try:
                    self._report_down(w)
                except Exception:  # supervision must outlive any one failure
                    logger.exception("supervising %s", w.name)
                # In its own thread: loading a model takes a while, and other
                # workers' deaths must be reported meanwhile.
                threading.Thread(target=self._restart, args=(w,), daemon=True, name=f"restart-{w.name}").start()
            try:
                self._watch_store()
            except Exception:  # supervision must outlive any one failure
                logger.exception("supervising the KV store")

    def _hung(self) -> set[str]:
        """The workers the router declared dead for their silence, asked once a pass."""
        try:
            return self.silent()
        except Exception:  # the router is stopping, or too busy to answer: next pass
            return set()

    def _kill_hung(self, w: Worker) -> None:
        """A process the router declared dead for its silence still runs: stopped or
        wedged. Kill it (its exit is then handled as a crash, next pass): alive, a hung
        prefill worker keeps decode workers' blocks fenced, and a hung worker of either
        pool could wake and write KV into blocks given to others since."""
        logger.warning("worker %s has not answered the router for router.worker_timeout_s but its process "
                       "runs: killing it and its follower ranks (a hung worker could still write KV)", w.name)
        w.process.kill_group()

    def _member(self, w: Worker) -> bool:
        """Still in its pool (a worker scaled down is stopped, not crashed)."""
        with self._lock:
            return any(x is w for x in self.workers.all)

    def _crashed(self, process: ForkedProcess) -> bool:
        """Whether an exited process is taken for crashed: not yet if it died of SIGTERM,
        or after its fork server, until SIGTERM_GRACE_S passed without a shutdown."""
        if process.exitcode != -signal.SIGTERM and process.exit_known:
            return True
        return self._grace_over(process)

    def _grace_over(self, process: ForkedProcess) -> bool:
        """Whether SIGTERM_GRACE_S passed since this sweep first saw `process` dead
        (others' deaths are handled meanwhile)."""
        first = self._sigterm_seen.setdefault(id(process), time.monotonic())
        return time.monotonic() - first >= SIGTERM_GRACE_S

    def _watch_store(self) -> None:
        """Start the store again if its process exited: one start at a time, in a thread
        (its bind may wait for the port), at most max_restarts in all."""
        store = self.workers.store
        if store is None or self._store_down or self._stop.is_set() or store.process.is_alive():
            return
        if self._store_restart is not None and self._store_restart.is_alive():
            return
        if not self._crashed(store.process):
            return
        if store is not self._store_seen_dead:  # once per death, not once per try
            self._store_seen_dead = store
            logger.warning("the KV store at %s exited with %s; starting it again there", store.address,
                           store.process.exitcode)
        if self.restarts[STORE] >= self.max_restarts:
            self._store_down = True
            logger.error("the KV store stays down: started %d times; the workers compute what they would "
                         "have loaded from it", self.restarts[STORE])
            return
        self.restarts[STORE] += 1
        self._store_restart = threading.Thread(target=self._restart_store, args=(store, self.restarts[STORE]),
                                               daemon=True, name="restart-kv-store")
        self._store_restart.start()

    def _restart_store(self, dead: StoreProcess, restart: int) -> None:
        try:
            new = restart_store(dead, self.config, self.workers.secret)
        except Exception as exc:  # the next sweep tries again, up to max_restarts
            logger.error("the KV store did not restart at %s (start %d of %d): %s", dead.address, restart,
                         self.max_restarts, exc)
            return
        with self._lock:  # LocalWorkers.stop takes the store under it: this one, or the new one
            stopping = self._stop.is_set()
            if not stopping:
                self.workers.store = new
        if stopping:  # the deployment stops: the workers' stop may have taken the dead one
            new.stop()
            return
        console.worker_back(STORE, new.address, time.monotonic() - new.started, restart, self.max_restarts)

    def _report_down(self, dead: Worker) -> None:
        logger.warning("worker %s exited with %s; telling its peers and the router", dead.name,
                       dead.process.exitcode)
        self.gone.add(dead.name)
        self.down(dead.name)
        if dead.metadata:  # a killed worker could not remove its shared memory
            unlink_segment(dead.metadata)
        sweep_orphans()  # its TP rank caches, even if it died before saying ready
        self.workers.tell_peers()

    def _restart(self, dead: Worker) -> None:
        """Start it again until one start serves, at most max_restarts starts in all."""
        while self.restarts[dead.name] < self.max_restarts and not self._stop.is_set() and self._member(dead):
            self.restarts[dead.name] += 1
            if self._start(dead):
                return
        if not self._stop.is_set() and self._member(dead):
            logger.error("worker %s stays down: started %d times", dead.name, self.restarts[dead.name])
            self.stays_down(dead.name, f"stays down: it was started again {self.restarts[dead.name]} times "
                                       "(local.max_restarts); no restart will come until the deployment restarts")

    def _start(self, dead: Worker) -> bool:
        role = dead.role
        new = spawn(self.config, role, dead.index, self.workers.secret, self.workers.store_address)  # the deployment's, as before
        with self._lock:
            self._starting[new.name] = new
        try:
            await_ready(new, self.start_timeout_s)
            with self._lock:
                to_decode, to_prefill = self.workers.peers_messages()
            new.control.send_bytes(to_decode if role == "decode" else to_prefill)
            await_serving(new, self.start_timeout_s)
        except Exception as exc:
            logger.error("worker %s did not restart: %s", dead.name, exc)
            with self._lock:
                self._starting.pop(new.name, None)
            stop_processes([new])  # also removes its shared memory
            return False
        with self._lock:
            self._starting.pop(new.name, None)
            pool = self.workers.decode if role == "decode" else self.workers.prefill
            at = next((i for i, w in enumerate(pool) if w is dead), None)
            if self._stop.is_set() or at is None:  # shutting down, or scaled down meanwhile
                stop_processes([new])
                return True
            new.draining = dead.draining
            pool[at] = new
            self.gone.discard(new.name)
        self.workers.tell_peers()  # the other pool learns it (a prefill worker makes its handshake)
        self.moved(new.name, new.address)
        console.worker_back(new.name, new.address, time.monotonic() - new.started, self.restarts[dead.name],
                            self.max_restarts)
        return True
