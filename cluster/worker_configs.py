"""From the cluster config to what each worker process is started with."""

from __future__ import annotations

from cluster.config import ClusterConfig
from workers.config import WorkerConfig


def stall_grace_s(config: ClusterConfig) -> float:
    """How long a stalled worker still answers (stalled) before it exits: two of the
    router's health pings, so that the router reads it and fails its requests over."""
    return max(1.0, 2 * config.router.health_interval_s)


def worker_config(config: ClusterConfig, role: str, index: int, host: str = "127.0.0.1") -> WorkerConfig:
    """Worker `index` of pool `role`, its sockets listening on `host`."""
    return WorkerConfig(role, index, config.engine_config(role), config.transport, config.transport_config(host),
                        config.router.stall_timeout_s or None, stall_grace_s(config), config.prefill_deadline_s,
                        config.router.prefill_max_outstanding)
