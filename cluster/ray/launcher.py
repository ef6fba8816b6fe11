"""The Ray launcher (cluster/launcher.py's interface): workers as Ray actors in
placement groups (workers.py), restarted by Ray and wired back in by supervisor.py;
`pdserve serve` runs the router and workers in a deployment actor (deployment.py),
which can outlive the command."""

from __future__ import annotations

from cluster.config import ClusterConfig, check_ray_model_dir
from cluster.launcher import RouterHooks
from cluster.ray.deployment import down, serve_on_ray
from cluster.ray.elastic import RayPools
from cluster.ray.workers import RayWorkers, start_ray_workers


class RayLauncher:
    restarts_workers = True  # Ray restarts a crashed actor (up to ray.max_restarts)
    detachable = True

    def check(self, config: ClusterConfig) -> None:
        check_ray_model_dir(config)

    def start(self, config: ClusterConfig) -> RayWorkers:
        return start_ray_workers(config)

    def pools(self, config: ClusterConfig, workers: RayWorkers) -> RayPools:
        return RayPools(config, workers)

    def supervise(self, config: ClusterConfig, workers: RayWorkers, router: RouterHooks) -> None:
        workers.supervise(config.ray, router)

    def serve(self, config: ClusterConfig, detach: bool) -> None:
        serve_on_ray(config, detach)

    def down(self, config: ClusterConfig) -> str:
        return down(config.ray)
