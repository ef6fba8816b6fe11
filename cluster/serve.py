"""`pdserve serve CONFIG`: the workers (local processes, or Ray actors with
`launcher: ray`), and the router in front, in this process."""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import TYPE_CHECKING

import uvicorn

from cluster.config import ClusterConfig
from cluster.local import LocalWorkers, start_workers
from router.app import Router, create_app

if TYPE_CHECKING:
    from cluster.ray_launcher import RayWorkers

logger = logging.getLogger(__name__)


def start(config: ClusterConfig) -> "LocalWorkers | RayWorkers":
    """The config's workers, started by its launcher; both kinds have .decode, .prefill
    (each worker with .name and .address) and .stop()."""
    if config.launcher == "ray":
        from cluster.ray_launcher import start_ray_workers  # Ray is imported only when used

        return start_ray_workers(config)
    return start_workers(config)


def build(config: ClusterConfig) -> tuple["LocalWorkers | RayWorkers", Router]:
    """The workers and the router in front of them; on Ray, supervised (restarted
    workers are wired back in, cluster/supervisor.py)."""
    workers = start(config)
    try:
        router = Router(config, {w.name: w.address for w in workers.decode}, bool(workers.prefill))
        if config.launcher == "ray":
            from cluster.supervisor import RouterHooks

            workers.supervise(config.ray, RouterHooks(router.decode_worker_down, router.decode_worker_moved))
    except BaseException:
        workers.stop()
        raise
    return workers, router


def serve(config: ClusterConfig) -> None:
    """Blocks until Ctrl-C (or SIGTERM), then stops the router and every worker."""
    workers, router = build(config)
    host, port = config.router.host, config.router.port
    # The HTTP server runs in a thread, so the signals stay here: one orderly shutdown.
    server = uvicorn.Server(uvicorn.Config(create_app(router), host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="router", daemon=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        thread.start()
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"the router could not start on {host}:{port} (see above)")
            time.sleep(0.05)
        print(f"pdserve: serving {config.model} at http://{host}:{port}/v1 "
              f"({len(workers.prefill)} prefill + {len(workers.decode)} decode workers, "
              f"{config.transport} transport, {config.launcher} launcher); Ctrl-C stops", flush=True)
        while not stop.wait(0.5) and thread.is_alive():
            pass
    finally:
        server.should_exit = True
        thread.join(10)
        workers.stop()
        print("pdserve: stopped", flush=True)
