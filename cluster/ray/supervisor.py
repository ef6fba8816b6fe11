"""Supervision of a Ray deployment's workers: tell everyone when one dies, and when
Ray has restarted it, wire it back in.

Ray restarts a crashed worker actor in its placement-group bundle (up to
`ray.max_restarts` times) by running its constructor again in a new process: a new
ZMQ address, a new KV cache and new transport metadata. A worker that gives up on its
own (an error it cannot recover from, a stall, a hung step: workers/loop.py)
ends its actor's process too (cluster/ray/actor.py), so it is restarted the same way.
Nobody else would know. This
thread asks every worker for its incarnation each `ray.probe_interval_s`; each pass
first classifies every worker, then acts:

- down: Ray reports it dead or restarting, or it did not answer within
  `ray.probe_timeout_s`. A silent one is killed first (Ray restarts it), so "down"
  always means its process is gone: a hung prefill worker must not wake up and write
  into blocks its decode worker has reused. Its peers are told at once, so nothing
  waits for a deadline: prefill workers drop a dead decode worker as a KV destination
  (its jobs end); decode workers drop a dead prefill worker and prefill locally the
  prompts it was computing (KVTransport.peer_gone); the router fails the requests of a
  dead decode worker over to a live one (router/worker_client.py) without waiting for
  its own health timeout.
- a new incarnation: Ray restarted it. Its "ready" (address, metadata) is awaited
  without blocking the passes; then, in this order: it gets its peers and starts
  serving (its handshakes made), the other pool learns it (a prefill worker's
  `add_peer` under a known name with new metadata replaces the dead peer, and jobs for
  the old process end: their blocks are not the new one's), and last the router
  learns its address, so no request reaches it before its peers know it. A restarted
  worker that fails to start is killed, for Ray to try again (bounded).

Calls to a worker carry the incarnation they are meant for: one that reaches a process
restarted meanwhile is refused, not taken as its own. Requests and KV never pass here.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import ray

from cluster.launcher import RouterHooks
from kv_transfer.shm_segments import unlink_segment
from protocol import CONTROL_MESSAGES, Ready

if TYPE_CHECKING:
    from cluster.ray.workers import RayWorker, RayWorkers

logger = logging.getLogger(__name__)

PEERS_WAIT_S = 30.0  # a live worker acts on a peers message within one loop iteration


class Supervisor:
    def __init__(self, workers: RayWorkers, router: RouterHooks | None, interval_s: float,
                 probe_timeout_s: float, ready_timeout_s: float = 180.0) -> None:
        self.workers = workers
        self.router = router
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.restarts = 0  # restarted workers wired back in
        # name -> (new incarnation, its pending ready() call, give up at): restarted
        # workers whose start is awaited across passes (loading a model takes a while)
        self._starting: dict[str, tuple[str, Any, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pdserve-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # supervision must outlive one bad pass (e.g. Ray busy)
                logger.exception("supervisor pass failed")

    def check(self) -> None:
        """One pass: probe, classify, then handle deaths, then restarts. Under the
        workers' lock: a scale-up or scale-down (cluster/ray/elastic.py) happens between
        two passes, never within one."""
        with self.workers.lock:
            self._check()

    def _check(self) -> None:
        self._collect_restarts()
        watched = [w for w in self.workers.all if w.name not in self._starting]
        probes = [w.actor.incarnation.remote() for w in watched]
        done, _ = ray.wait(probes, num_returns=len(probes), timeout=self.probe_timeout_s) if probes else ([], [])
        down, restarted = [], []
        for w, ref in zip(watched, probes):
            incarnation, reason = None, f"no answer within {self.probe_timeout_s:g} s"
            if ref in done:
                try:
                    incarnation, reason = ray.get(ref), ""
                except ray.exceptions.RayError as exc:
                    reason = first_line(exc)
            if incarnation == w.incarnation:
                continue
            if incarnation is None and not reason.startswith(("ActorDiedError", "ActorUnavailableError")) \
                    and w.alive:
                ray.kill(w.actor, no_restart=False)  # silent, maybe hung: make sure it is gone
            if w.alive:
                down.append((w, reason or "restarted by Ray"))
            if incarnation is not None:
                restarted.append((w, incarnation))
        for w, _ in down:  # all of them first, so no message goes to one that is down
            w.alive = False
        for w, reason in down:
            logger.warning("worker %s is down (%s): its peers stop using it", w.name, reason)
            if self.router is not None:
                self.router.down(w.name)
        roles = {w.role for w, _ in down}
        if "decode" in roles:
            self.workers.tell(self.workers.prefill)
        if "prefill" in roles:
            self.workers.tell(self.workers.decode)
        for w, incarnation in restarted:
            self._starting[w.name] = (incarnation, w.actor.ready.remote(self.ready_timeout_s),
                                      time.monotonic() + self.ready_timeout_s + 30)

    def _collect_restarts(self) -> None:
        """Wire in every restarted worker whose "ready" has come; kill one that failed
        to start or took too long, so that Ray tries again. A worker scaled down while
        Ray restarted it is dropped: it left its pool, and its actor was killed."""
        members = {w.name for w in self.workers.all}
        for name in [n for n in self._starting if n not in members]:
            del self._starting[name]
        for w in self.workers.all:
            if w.name not in self._starting:
                continue
            incarnation, ref, deadline = self._starting[w.name]
            done, _ = ray.wait([ref], timeout=0)
            if not done and time.monotonic() < deadline:
                continue
            del self._starting[w.name]
            try:
                if not done:
                    raise TimeoutError(f"not ready within {self.ready_timeout_s:g} s")
                self._wire_in(w, incarnation, CONTROL_MESSAGES.decode(ray.get(ref)))
            except (ray.exceptions.RayError, TimeoutError, RuntimeError) as exc:
                logger.warning("restarted worker %s did not start (%s): restarting it again", w.name,
                               first_line(exc))
                ray.kill(w.actor, no_restart=False)

    def _wire_in(self, w: RayWorker, incarnation: str, ready: Ready) -> None:
        if w.metadata:  # the dead process could not remove its shared memory
            unlink_segment(w.metadata)
        w.address, w.metadata, w.incarnation = ready.address, ready.metadata, incarnation
        # Itself first (it starts serving and makes its handshakes with peers that are
        # polling), then the other pool, then the router, so no request reaches it
        # before its peers know it.
        to_decode, to_prefill = self.workers.peers_messages()
        cold = ray.get(w.actor.start_serving.remote(to_decode if w.role == "decode" else to_prefill, incarnation),
                       timeout=PEERS_WAIT_S * 2)
        if cold:
            logger.warning("%s has no KV handshake with %s", w.name, ", ".join(cold))
        w.alive = True
        self.workers.tell(self.workers.prefill if w.role == "decode" else self.workers.decode)
        if self.router is not None:
            self.router.moved(w.name, w.address)
        self.restarts += 1
        logger.warning("worker %s restarted by Ray and back in service at %s", w.name, w.address)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
