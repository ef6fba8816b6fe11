"""Supervision of a Ray deployment's workers: tell everyone when one dies, and when
Ray has restarted it, wire it back in.

Ray restarts a crashed worker actor in its placement-group bundle (up to
`ray.max_restarts` times) by running its constructor again in a new process: a new
ZMQ address, a new KV cache and new transport metadata. Nobody else would know. This
thread asks every worker for its incarnation each `ray.probe_interval_s`:

- no answer within `ray.probe_timeout_s` (dead, restarting, or hung): the worker is
  down. Its peers are told at once, so nothing waits for a deadline: prefill workers
  drop a dead decode worker as a KV destination (their writes to it fail); decode
  workers drop a dead prefill worker, and prefill locally the prompts it was computing
  (KVTransport.peer_gone); the router fails the requests of a dead decode worker over
  to a live one (router/worker_client.py) without waiting for its own health timeout.
- a new incarnation: Ray restarted it. Its "ready" gives the new address and metadata;
  then, in this order: it learns its peers (it starts serving and handshakes with
  them), the other pool learns it (a prefill worker's `add_peer` under a known name
  with new metadata replaces the dead peer), and last the router learns its address,
  so no request reaches it before its peers know it (a decode worker is routed to
  again once it answers a ping).

Peer updates are "peers" messages through the actor (cluster/control.py), each waited
for until the worker has acted on it. Requests and KV never pass through here.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import ray

from cluster.control import peers_messages
from kv_transfer.shm import unlink_segment
from router.protocol import decode

if TYPE_CHECKING:
    from cluster.ray_launcher import RayWorker, RayWorkers

logger = logging.getLogger(__name__)

PEERS_WAIT_S = 30.0  # a live worker acts on a peers message within one loop iteration


class RouterHooks:
    """What the supervisor tells the router about workers of either pool; both are
    called from the supervisor's thread (the router's own methods hop onto its event
    loop)."""

    def __init__(self, down: Callable[[str], None], moved: Callable[[str, str], None]) -> None:
        self.down = down  # (name): declared dead; a decode worker's requests fail over
        self.moved = moved  # (name, new ZMQ address): restarted there


class Supervisor:
    def __init__(self, workers: "RayWorkers", router: RouterHooks | None, interval_s: float,
                 probe_timeout_s: float, ready_timeout_s: float = 180.0) -> None:
        self.workers = workers
        self.router = router
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.restarts = 0  # restarted workers wired back in
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
        """One pass: probe every worker, handle deaths, then restarts."""
        probes = {id(w): w.actor.incarnation.remote() for w in self.workers.all}
        done, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=self.probe_timeout_s)
        done_set = set(done)
        for w in self.workers.all:
            ref = probes[id(w)]
            incarnation = None
            if ref in done_set:
                try:
                    incarnation = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    reason = _first_line(exc)
                else:
                    reason = ""
            else:
                reason = f"no answer within {self.probe_timeout_s:g} s"
            if incarnation is not None and incarnation == w.incarnation:
                continue
            if w.alive:  # died (or died and came back since the last pass)
                self._down(w, reason or "restarted by Ray")
            if incarnation is not None and not self._stop.is_set():
                self._restarted(w, incarnation)

    def _down(self, w: "RayWorker", reason: str) -> None:
        logger.warning("worker %s is down (%s): its peers stop using it", w.name, reason)
        w.alive = False
        if self.router is not None:
            self.router.down(w.name)
        if w.role == "decode":
            self._tell(self.workers.prefill)
        else:
            self._tell(self.workers.decode)

    def _restarted(self, w: "RayWorker", incarnation: str) -> None:
        try:
            ready = decode(ray.get(w.actor.ready.remote(self.ready_timeout_s), timeout=self.ready_timeout_s + 30))
        except (ray.exceptions.RayError, TimeoutError) as exc:
            logger.warning("restarted worker %s did not become ready: %s", w.name, _first_line(exc))
            return
        if w.metadata:  # the dead process could not remove its shared memory
            unlink_segment(w.metadata)
        w.address, w.metadata, w.incarnation, w.alive = ready["address"], ready["metadata"], incarnation, True
        # Itself first (it starts serving, and polls its transport, which a peer's
        # handshake may need), then the other pool; the router last, so no request
        # reaches it before its peers know it.
        self._tell([w])
        self._tell(self.workers.prefill if w.role == "decode" else self.workers.decode)
        if self.router is not None:
            self.router.moved(w.name, w.address)
        self.restarts += 1
        logger.warning("worker %s restarted by Ray and back in service at %s", w.name, w.address)

    def _tell(self, targets: "list[RayWorker]") -> None:
        """Send each live target the peers message for its role: the live workers of the
        other pool. Waits until each has acted on it."""
        live_decode = [w for w in self.workers.decode if w.alive]
        live_prefill = [w for w in self.workers.prefill if w.alive]
        to_decode, to_prefill = peers_messages(live_decode, live_prefill)
        targets = [t for t in targets if t.alive]
        refs = [t.actor.peers.remote(to_decode if t.role == "decode" else to_prefill, PEERS_WAIT_S)
                for t in targets]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PEERS_WAIT_S + 5) if refs else ([], [])
        for t, ref in zip(targets, refs):
            if ref not in ready:
                logger.warning("worker %s did not take its new peers in time", t.name)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
