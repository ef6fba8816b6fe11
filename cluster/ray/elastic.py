"""The Ray launcher's pools, grown and shrunk at runtime (cluster/elastic.py's
PoolBackend); cluster/local/elastic.py is the same for worker processes.

A worker added takes the path a worker Ray restarted takes (ready, its peers and
serving, then the other pool learns it), under a name never used before, in a
placement it holds alone: a bundle of its pool's shared placement group that a
scale-down freed, if there is one, else a new group of one worker's bundles (one per
tensor-parallel rank, STRICT_PACK), which Ray must place within `ray.placement_timeout_s`.
A worker removed leaves its pool first (so the supervisor takes neither its stop nor
its death for a crash, and no Peers message names it), then the other pool is told,
then its actor is stopped and killed for good. Its own group is removed; a bundle of
the shared group is kept, reserved, for the next scale-up (a Ray placement group
cannot shrink), so a pool scaled down from its initial size still holds that size's
resources until the deployment stops.

Every change to the pools and every Peers message is made under the workers' lock,
which the supervisor holds for each of its passes (cluster/ray/supervisor.py); the
slow parts (placing, loading the model, stopping) run outside it.
"""

from __future__ import annotations

import logging
import time

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from cluster import console
from cluster.config import ClusterConfig
from cluster.ray.resources import PlacementError, Resources, fmt_resources, rank_bundles
from cluster.ray.supervisor import PEERS_WAIT_S, first_line
from cluster.ray.workers import RayWorker, RayWorkers, await_all_ready, new_actor
from kv_transfer.shm_segments import unlink_segment

logger = logging.getLogger(__name__)


class RayPools:
    """Who calls what: PoolScaler (cluster/elastic.py), one scale at a time, from the
    thread that serves a scale request; never the supervisor."""

    def __init__(self, config: ClusterConfig, workers: RayWorkers, start_timeout_s: float = 180.0,
                 stop_timeout_s: float = 10.0) -> None:
        self.config = config
        self.workers = workers
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s

    def pool(self, role: str) -> list[RayWorker]:
        return self.workers.pool(role)

    def add_worker(self, role: str) -> RayWorker:
        """Start one more worker of `role` and return it once it serves and the other
        pool knows it. Raises PlacementError (Ray could not place it in time: what it
        needs and what is free) or RuntimeError (it did not start), leaving nothing
        behind: its actor killed, its new group removed or its reused bundle free again."""
        with self.workers.lock:
            if self.workers.closed:
                raise RuntimeError("the deployment is stopping")
            index = self.workers.next_index(role)
            free = self.workers.free_bundles.get(role, [])
            reused = free.pop(0) if free else None
        name = f"{role}-{index}"
        if reused is not None:
            group, bundle, own = reused[0], reused[1], False
            logger.info("%s takes bundle %d of the %s pool's placement group, freed by a scale-down",
                        name, bundle, role)
        else:
            group, bundle, own = self._new_group(role, name), 0, True
        worker = RayWorker(name, role, None, group=group, bundle=bundle, own_group=own)
        try:
            started = time.monotonic()
            worker.actor = new_actor(self.config, role, index, group, bundle, self.workers.secret,
                                     self.workers.store_address)
            console.worker_starting(name, self.config.engine_config(role))
            self._start(worker, started)
        except BaseException:
            if worker.actor is not None:
                ray.kill(worker.actor, no_restart=True)
            if worker.metadata:
                unlink_segment(worker.metadata)
            self._release(worker)
            raise
        return worker

    def _new_group(self, role: str, name: str) -> PlacementGroup:
        """A placement group for one worker of `role`, placed; PlacementError (the group
        removed) if Ray cannot place it within ray.placement_timeout_s. STRICT_PACK: a
        TP worker's ranks on one node, as at start (a single bundle is on one node anyway)."""
        bundles = rank_bundles(self.config, role)
        group = placement_group(bundles, strategy="STRICT_PACK")
        timeout = self.config.ray.placement_timeout_s
        done, _ = ray.wait([group.ready()], timeout=timeout)
        if not done:
            remove_placement_group(group)
            need = _summed(bundles)
            free = {k: ray.available_resources().get(k, 0.0) for k in need}
            raise PlacementError(f"Ray did not place {name} within {timeout:g} s (ray.placement_timeout_s): it "
                                 f"needs {fmt_resources(need)} on one node; free in the cluster now: "
                                 f"{fmt_resources(free)}")
        with self.workers.lock:
            if not self.workers.closed:
                self.workers.groups.append(group)  # released by stop() if the deployment stops first
                return group
        remove_placement_group(group)
        raise RuntimeError("the deployment is stopping")

    def _start(self, worker: RayWorker, started: float) -> None:
        """Ready, then its peers (it serves, its handshakes made), then into its pool and
        the other pool told: the order a restarted worker is wired in."""
        try:
            await_all_ready([worker], self.start_timeout_s, started)
            worker.incarnation = ray.get(worker.actor.incarnation.remote(), timeout=30)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise RuntimeError(f"{worker.name} did not start: {first_line(exc)}") from None
        with self.workers.lock:
            if self.workers.closed:
                raise RuntimeError("the deployment is stopping")
            to_decode, to_prefill = self.workers.peers_messages()
            message = to_decode if worker.role == "decode" else to_prefill
            try:
                cold = ray.get(worker.actor.start_serving.remote(message, worker.incarnation),
                               timeout=PEERS_WAIT_S * 2)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                raise RuntimeError(f"{worker.name} did not take its peers: {first_line(exc)}") from None
            if cold:
                logger.warning("%s has no KV handshake with %s: their prompts are prefilled locally",
                               worker.name, ", ".join(cold))
            self.pool(worker.role).append(worker)
            self.workers.tell(self._others(worker.role))

    def set_draining(self, name: str) -> None:
        """A draining prefill worker gets no new prompt from the decode workers (told
        now, and in every later Peers message); a draining decode worker is the
        router's business only."""
        with self.workers.lock:
            worker = self._find(name)
            worker.draining = True
            if worker.role == "prefill":
                self.workers.tell(self.workers.decode)

    def remove_worker(self, name: str) -> None:
        """Out of its pool, the other pool told, then stopped, killed for good (Ray does
        not restart it), its shared memory removed and its placement released. A decode
        worker is stopped after its prefill workers drop it as a KV destination (their
        jobs for it end); a prefill worker before its decode workers learn it is gone,
        for they then release the blocks it was writing and prefill those prompts
        locally in them, which only a sender that has exited cannot write into any more
        (as after a crash)."""
        with self.workers.lock:
            worker = self._find(name)
            self.pool(worker.role).remove(worker)
            if worker.role == "decode":
                self.workers.tell(self._others(worker.role))
        if worker.alive:  # a dead or restarting one has no loop to stop
            try:
                ray.get(worker.actor.stop.remote(self.stop_timeout_s), timeout=self.stop_timeout_s + 5)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                logger.warning("%s did not stop cleanly (%s): killing it", name, first_line(exc))
        ray.kill(worker.actor, no_restart=True)
        _await_death(worker, self.stop_timeout_s)
        if worker.role == "prefill":
            with self.workers.lock:
                self.workers.tell(self._others(worker.role))
        if worker.metadata:  # a killed worker cannot remove its shared memory itself
            unlink_segment(worker.metadata)
        self._release(worker)

    def _release(self, worker: RayWorker) -> None:
        """Its own group removed; a bundle of the shared group kept for the next scale-up."""
        with self.workers.lock:
            if self.workers.closed or worker.group is None:  # stop() releases every group
                return
            if worker.own_group:
                remove_placement_group(worker.group)
                self.workers.groups.remove(worker.group)
            else:
                self.workers.free_bundles.setdefault(worker.role, []).insert(0, (worker.group, worker.bundle))

    def _others(self, role: str) -> list[RayWorker]:
        return self.workers.prefill if role == "decode" else self.workers.decode

    def _find(self, name: str) -> RayWorker:
        for w in self.workers.all:
            if w.name == name:
                return w
        raise LookupError(f"no worker named {name} in the deployment")


def _await_death(worker: RayWorker, timeout: float) -> None:
    """Until its actor is dead, so that its resources are free when the scale-down
    returns (ray.kill goes through Ray's control store: calls made meanwhile may still
    be answered)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            ray.get(worker.actor.pid.remote(), timeout=max(0.1, end - time.monotonic()))
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            break
        time.sleep(0.05)
    logger.warning("%s was killed but its actor still answered after %g s", worker.name, timeout)


def _summed(bundles: list[Resources]) -> Resources:
    total: Resources = {}
    for bundle in bundles:
        for key, value in bundle.items():
            total[key] = total.get(key, 0.0) + value
    return total
