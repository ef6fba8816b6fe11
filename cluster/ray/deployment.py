"""A deployment on Ray: the router, its workers and their supervisor, owned by one actor.

`pdserve serve CONFIG` (launcher: ray) connects to Ray, checks the config against the
cluster (a config it cannot hold fails before any actor starts), then creates a
`DeploymentActor` on this node, so that the HTTP endpoint is where the command ran
(for a Ray job: the head node). The actor starts the workers (cluster/ray/workers.py),
serves HTTP from a thread, and supervises the workers (cluster/ray/supervisor.py). The
worker actors and placement groups belong to it: if it dies, Ray ends them too.

- Attached (the default, and under `ray job submit`): the command waits for Ctrl-C or
  SIGTERM (`ray job stop`), then stops the deployment; if the command dies, Ray ends
  the actor with its job.
- `--detach`: the actor is detached and named `ray.name` in namespace "pdserve"; the
  command returns once it serves, and `pdserve down CONFIG` stops it. This needs a Ray
  cluster that outlives the command (`ray start`; not a private `address: local` one).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.config import ClusterConfig, RayConfig
from cluster.ray.resources import PlacementError
from cluster.ray.workers import check_capacity, connect

logger = logging.getLogger(__name__)

NAMESPACE = "pdserve"
START_TIMEOUT_S = 300.0  # placement, every worker loading its model, the router
SHUTDOWN_S = 45.0  # DeploymentActor.shutdown's worst case: planner 5 s, router 5 s, supervisor and workers 10 + 20 s


class DeploymentActor:
    """Who calls what: `pdserve serve` calls start() once, then shutdown() when it
    stops; `pdserve down` calls shutdown(); `pdserve scale` calls scale()
    (cluster/ray/scale.py), which may take minutes while status() and pools() still
    answer (max_concurrency); status() and pools() are for tests and operators."""

    def __init__(self, config: ClusterConfig) -> None:
        # Nothing that can fail here: an exception in the constructor would come back
        # as an opaque actor death; from start() it comes back as itself.
        self.config = config
        self.workers: Any = None  # RayWorkers
        self.router: Any = None  # router.app.Router; its scaler grows and shrinks the pools
        self.http: Any = None  # cluster.serve.HTTPServer
        self.planner: Any = None  # cluster.autoscale.loop.PlannerLoop, when autoscale.enabled

    def start(self) -> str:
        """Start the workers and the router; returns the endpoint's URL."""
        from cluster import console
        from cluster.autoscale.run import start_planner
        from cluster.serve import HTTPServer, build  # the router's imports, in the actor only

        # This actor's stderr is what Ray forwards to the `pdserve serve` terminal.
        console.configure()
        self.workers, self.router = build(self.config)
        try:
            self.http = HTTPServer(self.router, self.config.router.host, self.config.router.port)
        except BaseException:
            self.workers.stop()
            raise
        self.planner = start_planner(self.config, self.router)
        return self.http.url

    def scale(self, prefill: int | None, decode: int | None) -> dict[str, Any]:
        """Bring the pools to these sizes (None: leave that pool as it is) by the
        router's PoolScaler (cluster/elastic.py), the admin endpoint's; returns once
        done, its ScaleResult as a dict. ScaleError (a ValueError) for a target out of
        bounds, ScaleFailed (a RuntimeError) for a worker that would not start."""
        return self._scaler().scale(prefill, decode, reason="manual").as_dict()

    def pools(self) -> dict[str, Any]:
        """Each pool's workers taking work, and every worker: its state and placement."""
        sizes = self._scaler().sizes()
        with self.workers.lock:
            workers = [{"name": w.name, "role": w.role, "address": w.address, "alive": w.alive,
                        "draining": w.draining, "placement_group": w.group.id.hex() if w.group else "",
                        "bundle": w.bundle, "own_group": w.own_group} for w in self.workers.all]
        return {**sizes, "workers": workers}

    def _scaler(self) -> Any:
        if self.router is None or self.workers is None or self.router.scaler is None:
            raise RuntimeError(f"the deployment {self.config.ray.name!r} does not serve (not started, or stopping)")
        return self.router.scaler

    def status(self) -> dict[str, Any]:
        """Whether the endpoint serves; each worker's address and health as the
        supervisor sees it."""
        w = self.workers
        return {"url": self.http.url if self.http else "", "serving": bool(self.http and self.http.alive()),
                "restarts": w.supervisor.restarts if w and w.supervisor else 0,
                "workers": [{"name": x.name, "address": x.address, "alive": x.alive} for x in (w.all if w else [])]}

    def shutdown(self) -> None:
        """The planner, the router, then the workers; at most SHUTDOWN_S in all."""
        if self.planner is not None:
            self.planner.stop()
            self.planner = None
        if self.http is not None:
            self.http.stop(5.0)
            self.http = None
        self.router = None
        if self.workers is not None:
            self.workers.stop(10.0)  # bounded by about twice this (RayWorkers.stop)
            self.workers = None


def serve_on_ray(config: ClusterConfig, detach: bool) -> None:
    """`pdserve serve` with launcher: ray (see the module docstring)."""
    from cluster.serve import wait_for_signal

    if detach and config.ray.address == "local" and not os.environ.get("RAY_ADDRESS"):
        raise PlacementError("--detach needs a Ray cluster that outlives this command (ray.address: auto or "
                             "host:port, after `ray start --head`); address 'local' would start a private one")
    connect(config.ray)
    try:
        check_capacity(config)
        if _find(config.ray) is not None:
            raise PlacementError(f"a deployment named {config.ray.name!r} already runs on this Ray cluster "
                                 f"(`pdserve down` stops it, or set ray.name)")
        actor = ray.remote(DeploymentActor).options(
            name=config.ray.name, namespace=NAMESPACE, lifetime="detached" if detach else None,
            num_cpus=0, max_restarts=0, max_concurrency=4,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        ).remote(config)
        try:
            url = unwrap(lambda: ray.get(
                actor.start.remote(),  # type: ignore[attr-defined]  # ray.remote adds .remote to actor methods
                timeout=START_TIMEOUT_S))
        except BaseException:
            _stop(actor)
            raise
        print(f"pdserve: serving {config.model} at {url}/v1 ({config.prefill.replicas} prefill + "
              f"{config.decode.replicas} decode workers, {config.transport} transport, on Ray as "
              f"{NAMESPACE}/{config.ray.name})", flush=True)
        if detach:
            print("pdserve: detached; `pdserve down` with this config stops it", flush=True)
            return
        print("pdserve: Ctrl-C stops", flush=True)
        try:
            wait_for_signal(lambda: _alive(actor))
        finally:
            _stop(actor)
            print("pdserve: stopped", flush=True)
    finally:
        if ray.is_initialized():
            ray.shutdown()  # leaves a joined cluster running; ends a private one


def down(config: RayConfig) -> str:
    """Stop the deployment named `config.name` on the cluster (detached, or the one a
    running `pdserve serve` holds); its URL. Raises LookupError if there is none."""
    connect(config)
    try:
        actor = _find(config)
        if actor is None:
            raise LookupError(f"no pdserve deployment named {config.name!r} on this Ray cluster")
        try:
            url = ray.get(actor.status.remote(), timeout=30)["url"]
        except (ray.exceptions.RayError, TimeoutError) as exc:  # a sick deployment is stopped all the same
            url = f"(unknown: {type(exc).__name__})"
        _stop(actor)
        return url
    finally:
        ray.shutdown()


def _find(config: RayConfig) -> Any:
    try:
        return ray.get_actor(config.name, namespace=NAMESPACE)
    except ValueError:
        return None


def _alive(actor: Any) -> bool:
    """Does the deployment still serve? (Its actor answers, and its HTTP thread runs.)"""
    try:
        if ray.get(actor.status.remote(), timeout=30)["serving"]:
            return True
        logger.error("the deployment's HTTP endpoint stopped")
    except (ray.exceptions.RayError, TimeoutError):
        logger.error("the deployment actor is gone")
    return False


def _stop(actor: Any) -> None:
    """Stop the router and workers in order, then end the actor (even if that failed)."""
    try:
        ray.get(actor.shutdown.remote(), timeout=SHUTDOWN_S + 10)
    except (ray.exceptions.RayError, TimeoutError) as exc:
        logger.warning("the deployment did not stop cleanly: %s", exc)
    ray.kill(actor, no_restart=True)


def unwrap(call: Any) -> Any:
    """Errors raised in the actor, as themselves (Ray wraps them in RayTaskError)."""
    try:
        return call()
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, (PlacementError, ValueError, FileNotFoundError, RuntimeError)):
            raise cause from None
        raise
