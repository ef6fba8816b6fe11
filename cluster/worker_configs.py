"""From the cluster config to what each worker process is started with."""

from __future__ import annotations

import dataclasses

from cluster.config import ClusterConfig
from security import DeploymentSecret
from workers.config import WorkerConfig
from workers.control import ControlChannel


def stall_grace_s(config: ClusterConfig) -> float:
    """How long a stalled worker still answers (stalled) before it exits: two of the
    router's health pings, so that the router reads it and fails its requests over."""
    return max(1.0, 2 * config.router.health_interval_s)


def worker_config(config: ClusterConfig, role: str, index: int, host: str = "127.0.0.1", *,
                  secret: DeploymentSecret | None, kv_store: str | None = None) -> WorkerConfig:
    """Worker `index` of pool `role`, its sockets listening on `host`; `secret`: its
    deployment's, made by the launcher (None only in tests: plain sockets); kv_store:
    the shared KV store's address, which a worker of a pool with a host tier uses."""
    transport = dataclasses.replace(config.transport_config(host), secret=secret)
    engine = config.engine_config(role)
    return WorkerConfig(role, index, engine, config.transport, transport,
                        config.router.stall_timeout_s or None, stall_grace_s(config), config.prefill_deadline_s,
                        config.router.prefill_max_outstanding, kv_store if engine.kv_offload_gib > 0 else None,
                        config.kv_store.fetch_timeout_s)


def without_router_secrets(config: ClusterConfig) -> ClusterConfig:
    """The config as a worker process may hold it: the API keys stay with the router (no
    worker reads them, and a worker's arguments may be kept, e.g. by Ray)."""
    return dataclasses.replace(config, router=dataclasses.replace(config.router, api_keys=None, admin_keys=None))


def serve_worker(config: WorkerConfig, control: ControlChannel) -> None:
    """A worker's life, in the process (or Ray actor thread) that runs it: its role's
    serve(). The roles' modules load torch and the engine: imported here, where the
    worker runs, so the launcher's process (where the router runs) loads neither."""
    if config.role == "decode":
        from decode_worker.server import serve
    else:
        from prefill_worker.server import serve
    serve(config, control)
