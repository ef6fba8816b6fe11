"""Start a cluster config's workers as Ray actors, and stop them.

The Ray counterpart of cluster/local/workers.py, step for step: a placement group per pool (one
bundle per worker: a bundle is always on one node, so each worker is packed; the pool's
workers are packed or spread as `ray.strategy` says; a tensor-parallel worker is a group
of its own, a bundle per rank, STRICT_PACK), one `WorkerActor` per worker
running the same worker entry point as a local process, then the same "ready" and
"peers" messages, carried by actor calls instead of a pipe. With kv_store.enabled the
shared KV store starts first, as an actor of its own (cluster/ray/kv_store.py), and is
killed after the workers. Ray only places and starts processes; requests and KV never
travel through it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray._private import services
from ray.util import placement_group_table
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster import console
from cluster.config import ClusterConfig, RayConfig
from cluster.launcher import RouterHooks
from cluster.peers import peers_messages
from cluster.ray.actor import WorkerActor
from cluster.ray.kv_store import start_store, stop_store
from cluster.ray.resources import (
    PlacementError,
    check_one_host_transport,
    missing_resources,
    pool_bundles,
    rank_bundles,
    tp_size,
)
from cluster.ray.supervisor import PEERS_WAIT_S, Supervisor, first_line
from cluster.worker_configs import without_router_secrets
from kv_transfer.shm_segments import unlink_segment
from protocol import CONTROL_MESSAGES
from security import DeploymentSecret

logger = logging.getLogger(__name__)

# KV and requests never go through Ray's object store; a local start keeps it small
# (Ray's default is 30% of RAM in /dev/shm, which the shm transport also uses).
LOCAL_OBJECT_STORE_BYTES = 256 << 20
# Threads per actor: ready() blocks in one while the worker thread starts; stop() and
# peers() must not queue behind it.
ACTOR_CONCURRENCY = 4


@dataclass(eq=False)
class RayWorker:
    name: str
    role: str  # "decode" | "prefill"
    actor: Any  # ray.actor.ActorHandle of a WorkerActor
    address: str = ""
    metadata: bytes = b""
    incarnation: str = ""  # the actor process's id (a restart changes it)
    alive: bool = True  # as the supervisor last saw it
    draining: bool = False  # being scaled down (cluster/elastic.py)
    # Where it runs: a bundle of its pool's shared group (own_group False), or bundle 0
    # of a group of its own (a TP worker, or one added at runtime), removed with it.
    group: PlacementGroup | None = None
    bundle: int = 0
    own_group: bool = False

    @property
    def index(self) -> int:
        return int(self.name.rpartition("-")[2])


@dataclass
class RayWorkers:
    decode: list[RayWorker] = field(default_factory=list)
    prefill: list[RayWorker] = field(default_factory=list)
    groups: list[PlacementGroup] = field(default_factory=list)
    shutdown_ray: bool = False  # this process connected to (or started) Ray: undo it on stop
    supervisor: Supervisor | None = None
    # The deployment's (start_ray_workers makes it): in every actor's constructor
    # arguments, so a restarted actor has it too; the router gets it from here.
    secret: DeploymentSecret | None = field(default=None, repr=False)
    # The shared KV store's actor and address (kv_store.enabled): the address is in every
    # worker actor's constructor arguments (a restarted store listens there again).
    store: Any = None
    store_address: str | None = None
    # Held while the pools change or a Peers message is made and sent: by each of the
    # supervisor's passes (which mutate RayWorker objects) and by the elastic pools'
    # adds and removals (cluster/ray/elastic.py), so that neither sees the other half done.
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    # The next index of each pool: a worker added at runtime never takes the name of one
    # that left (the router and /metrics know workers by name).
    indexes: dict[str, int] = field(default_factory=dict)
    # Role -> bundles of its shared placement group whose worker was scaled down: a
    # placement group cannot shrink, so they stay reserved for the next scale-up.
    free_bundles: dict[str, list[tuple[PlacementGroup, int]]] = field(default_factory=dict)
    closed: bool = False  # stop() began: nothing joins the pools any more

    def supervise(self, config: RayConfig, router: RouterHooks | None) -> Supervisor:
        """Start watching the workers (cluster/ray/supervisor.py); stop() ends it."""
        self.supervisor = Supervisor(self, router, config.probe_interval_s, config.probe_timeout_s)
        self.supervisor.start()
        return self.supervisor

    @property
    def all(self) -> list[RayWorker]:
        return self.decode + self.prefill

    def pool(self, role: str) -> list[RayWorker]:
        return self.decode if role == "decode" else self.prefill

    def next_index(self, role: str) -> int:
        """A never-used index for a new worker of `role` (call with the lock held)."""
        index = max([self.indexes.get(role, 0), *(w.index + 1 for w in self.pool(role))])
        self.indexes[role] = index + 1
        return index

    def peers_messages(self) -> tuple[bytes, bytes]:
        """The Peers message for a decode and for a prefill worker: the live workers of
        the other pool (call with the lock held)."""
        return peers_messages([w for w in self.decode if w.alive], [w for w in self.prefill if w.alive])

    def tell(self, targets: list[RayWorker]) -> None:
        """Send each live target the peers message for its role (call with the lock
        held). Waits until each has acted on it; one that fails is left to the
        supervisor's next probe."""
        to_decode, to_prefill = self.peers_messages()
        targets = [t for t in targets if t.alive]
        refs = [t.actor.peers.remote(to_decode if t.role == "decode" else to_prefill, t.incarnation, PEERS_WAIT_S)
                for t in targets]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=PEERS_WAIT_S + 5) if refs else ([], [])
        for t, ref in zip(targets, refs):
            try:
                ok = ref in done and ray.get(ref)
            except ray.exceptions.RayError as exc:
                ok, reason = False, first_line(exc)
            else:
                reason = "no answer in time"
            if not ok:
                logger.warning("worker %s did not take its new peers (%s)", t.name, reason)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every worker loop, kill the actors, free the placement groups, and
        disconnect from Ray (which stops a Ray this process started). Safe to call twice.
        Bounded in time: if Ray itself is gone (e.g. a signal to the whole process group
        reached a Ray started here first), its calls block, so they run in a thread that
        is abandoned after `timeout` + 10 s (Ray's processes die with their GCS)."""
        if self.supervisor is not None:  # first: a worker being stopped is not a crash
            self.supervisor.stop(timeout)
            self.supervisor = None
        # A scale-up still starting a worker sees `closed` and removes its own actor; the
        # lock is not waited for long (a scale holds it while a new worker takes its peers).
        locked = self.lock.acquire(timeout=timeout)
        self.closed = True
        if locked:
            self.lock.release()
        cleanup = threading.Thread(target=self._release, args=(timeout,), name="pdserve-ray-stop", daemon=True)
        cleanup.start()
        cleanup.join(timeout + 10)
        if cleanup.is_alive():
            logger.warning("Ray did not answer while stopping the workers; is the Ray cluster still up?")
        for w in self.all:
            if w.metadata:  # a worker killed mid-loop cannot remove its shared memory
                unlink_segment(w.metadata)
        self.decode, self.prefill, self.groups, self.free_bundles = [], [], [], {}

    def _release(self, timeout: float) -> None:
        if ray.is_initialized():
            pending = [w.actor.stop.remote(timeout) for w in self.all]
            if pending:
                ray.wait(pending, num_returns=len(pending), timeout=timeout)
            for w in self.all:
                ray.kill(w.actor, no_restart=True)
            for group in self.groups:
                remove_placement_group(group)
            if self.store is not None:  # after the workers, as the local launcher's
                stop_store(self.store, timeout)
                self.store = None
        if self.shutdown_ray and ray.is_initialized():
            self.shutdown_ray = False
            ray.shutdown()


def new_actor(config: ClusterConfig, role: str, index: int, group: PlacementGroup, bundle: int,
              secret: DeploymentSecret | None, kv_store: str | None = None) -> Any:
    """Create worker `index` of `role` as a WorkerActor in `group`'s bundle (it starts
    loading at once; ready() says when it has); `kv_store`: the shared store's address."""
    pool = getattr(config.ray, role)
    return ray.remote(WorkerActor).options(
        num_cpus=pool.num_cpus, num_gpus=pool.num_gpus, resources=pool.resources,
        max_concurrency=ACTOR_CONCURRENCY, max_restarts=config.ray.max_restarts, max_task_retries=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle),
        # Ray keeps an actor's arguments, for its restarts: no router secrets in them.
    ).remote(role, without_router_secrets(config), index, secret=secret, kv_store=kv_store)


def connect(config: RayConfig) -> bool:
    """Join or start the Ray cluster `config` names; True if this call did (so stop()
    undoes it), False if this process was already connected."""
    if ray.is_initialized():
        return False
    address = config.address
    if address == "local" and os.environ.get("RAY_ADDRESS"):
        # Run as a Ray job (`ray job submit`): the job's cluster is the one to use.
        logger.info("address 'local' inside a Ray job: using the job's cluster %s", os.environ["RAY_ADDRESS"])
        address = "auto"
    if address == "local":
        ray.init(address="local", num_cpus=config.num_cpus, include_dashboard=False,
                 object_store_memory=LOCAL_OBJECT_STORE_BYTES, _node_ip_address="127.0.0.1")
    else:
        probe_address(address)
        ray.init(address=address)
    return True


def probe_address(address: str, timeout: float = 5.0) -> None:
    """Fail in seconds if nobody listens where `address` points: ray.init retries a dead
    GCS for a minute or more (e.g. `auto` finding the file a stopped `ray start` left).
    The address is resolved by ray._private.services, as ray.init itself does (private:
    recheck on a Ray upgrade)."""
    try:
        target = address if address.startswith("ray://") else services.canonicalize_bootstrap_address(address)
    except ConnectionError as exc:  # `auto` with no cluster on this machine
        raise PlacementError(f"no Ray cluster for ray.address {address!r}: {exc}") from None
    host, _, port = (target or "").removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except (OSError, ValueError) as exc:
        raise PlacementError(f"no Ray cluster answers at {target} (ray.address {address!r}): {exc}; "
                             "is `ray start` running there?") from None


def check_capacity(config: ClusterConfig) -> None:
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    problems = missing_resources(pool_bundles(config), nodes)
    if problems:
        raise PlacementError("the Ray cluster cannot hold this config: " + "; ".join(problems))


def _place(config: ClusterConfig) -> dict[str, list[tuple[PlacementGroup, int]]]:
    """Role -> each worker's (ready placement group, its bundle), or PlacementError
    (with none left behind). A pool at tensor_parallel_size 1 is one group, a bundle
    per worker, packed or spread as `ray.strategy` says; at N > 1 each worker is a
    group of N bundles, one per rank, on one node (STRICT_PACK): the worker's actor
    holds bundle 0, and its followers, processes it starts, use the others."""
    groups: dict[str, list[PlacementGroup]] = {}
    places: dict[str, list[tuple[PlacementGroup, int]]] = {}
    for role, workers in pool_bundles(config).items():
        if tp_size(config, role) == 1:
            group = placement_group(rank_bundles(config, role) * len(workers), strategy=config.ray.strategy)
            groups[role], places[role] = [group], [(group, i) for i in range(len(workers))]
        else:
            groups[role] = [placement_group(rank_bundles(config, role), strategy="STRICT_PACK") for _ in workers]
            places[role] = [(group, 0) for group in groups[role]]
    waits = {group.ready(): role for role, role_groups in groups.items() for group in role_groups}
    done, _ = ray.wait(list(waits), num_returns=len(waits), timeout=config.ray.placement_timeout_s)
    late = sorted({role for ref, role in waits.items() if ref not in done})
    if late:
        for role_groups in groups.values():
            for group in role_groups:
                remove_placement_group(group)
        raise PlacementError(
            f"Ray did not place the {' and '.join(late)} pool(s) within {config.ray.placement_timeout_s:g} s "
            f"(strategy {config.ray.strategy}; each worker needs "
            f"{', '.join(f'{r}: {pool_bundles(config)[r][0]}' for r in late)}; "
            f"available now: {ray.available_resources()})")
    try:
        tables = {group.id: placement_group_table(group)["bundles_to_node_id"]
                  for role_groups in groups.values() for group in role_groups}
        check_one_host_transport(config.transport, {
            role: [tables[group.id][bundle] for group, bundle in role_places] for role, role_places in places.items()})
    except BaseException:  # refused, or the GCS did not answer: release what was placed
        for role_groups in groups.values():
            for group in role_groups:
                remove_placement_group(group)
        raise
    return places


def await_all_ready(workers: list[RayWorker], timeout: float, started: float) -> None:
    """Each worker's "ready" (address, metadata), taken as each comes, so that its line
    says when it was ready (of `started`, when its actor was created). Raises RayError
    (a worker failed) or TimeoutError."""
    end = time.monotonic() + timeout + 30  # the actor's own wait, then Ray's round trip
    pending = {w.actor.ready.remote(timeout): w for w in workers}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, end - time.monotonic()))
        if not done:
            raise TimeoutError(f"{', '.join(w.name for w in pending.values())} not ready within {timeout:g} s")
        w = pending.pop(done[0])
        ready = CONTROL_MESSAGES.decode(ray.get(done[0]))
        w.address, w.metadata = ready.address, ready.metadata
        console.worker_ready(w.name, w.address, time.monotonic() - started)


def start_ray_workers(config: ClusterConfig, timeout: float = 180.0) -> RayWorkers:
    """Connect to Ray, make the deployment's secret, place and start every worker with
    it, wait until each reports ready, then tell each its peers (as
    cluster.local.start_workers does). With kv_store.enabled the shared KV store's actor
    starts first. Raises, after stopping whatever started and releasing its resources,
    if any step fails."""
    # The initial workers' indexes are taken for good: a scale-up after the last of a
    # pool left must not name its worker "prefill-0" again.
    workers = RayWorkers(shutdown_ray=connect(config.ray), secret=DeploymentSecret.new(),
                         indexes={"decode": config.decode.replicas, "prefill": config.prefill.replicas})
    try:
        check_capacity(config)
        if config.kv_store.enabled:
            workers.store, workers.store_address = start_store(config, workers.secret)
        places = _place(config)
        workers.groups = list(dict.fromkeys(group for role_places in places.values() for group, _ in role_places))
        started = time.monotonic()
        for role, role_places in places.items():
            own = tp_size(config, role) > 1  # a TP worker is a group of its own (_place)
            for i, (group, bundle) in enumerate(role_places):
                actor = new_actor(config, role, i, group, bundle, workers.secret, workers.store_address)
                workers.pool(role).append(RayWorker(f"{role}-{i}", role, actor, group=group, bundle=bundle,
                                                    own_group=own))
                console.worker_starting(f"{role}-{i}", config.engine_config(role))
        try:
            await_all_ready(workers.all, timeout, started)
            incarnations = ray.get([w.actor.incarnation.remote() for w in workers.all], timeout=30)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise RuntimeError(f"a Ray worker did not start: {exc}") from None
        for w, incarnation in zip(workers.all, incarnations):
            w.incarnation = incarnation
        to_decode, to_prefill = peers_messages(workers.decode, workers.prefill)
        cold = ray.get([w.actor.start_serving.remote(to_decode if w.role == "decode" else to_prefill, w.incarnation)
                        for w in workers.all], timeout=90)
        for w, names in zip(workers.all, cold):
            if names:
                logger.warning("%s has no KV handshake with %s: their prompts are prefilled locally",
                               w.name, ", ".join(names))
    except BaseException:
        workers.stop()
        raise
    return workers
