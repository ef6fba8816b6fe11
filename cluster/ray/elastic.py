"""The Ray launcher's pools, grown and shrunk at runtime (cluster/elastic.py's
PoolBackend). Interim: being written (issue 22); scale requests on Ray are refused."""

from __future__ import annotations

from cluster.config import ClusterConfig
from cluster.ray.workers import RayWorker, RayWorkers


class RayPools:
    def __init__(self, config: ClusterConfig, workers: RayWorkers) -> None:
        self.config = config
        self.workers = workers

    def pool(self, role: str) -> list[RayWorker]:
        return self.workers.decode if role == "decode" else self.workers.prefill

    def add_worker(self, role: str) -> RayWorker:
        raise RuntimeError("scaling a Ray deployment is not built yet")

    def set_draining(self, name: str) -> None:
        raise RuntimeError("scaling a Ray deployment is not built yet")

    def remove_worker(self, name: str) -> None:
        raise RuntimeError("scaling a Ray deployment is not built yet")
