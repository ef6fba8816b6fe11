"""`pdserve serve CONFIG`: the workers and the router in front of them.

With `launcher: local` the workers are processes and the router runs here. With
`launcher: ray` all of it runs in a deployment actor on this node (cluster/ray_deployment.py),
which this command starts and, unless detached, stops.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import uvicorn

from cluster.config import ClusterConfig
from cluster.local import LocalWorkers, start_workers
from cluster.local_supervisor import LocalSupervisor
from router.app import Router, create_app
from router.config import ModelLimits

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


def router_for(config: ClusterConfig, decode_workers: dict[str, str],
               prefill_workers: dict[str, str] | None = None) -> Router:
    """The router in front of these workers (name -> address): the config's router
    section, and the limits of the model as the decode workers' engines will have them."""
    return Router(config.router, ModelLimits.of(config.engine_config("decode")), decode_workers, prefill_workers)


def build(config: ClusterConfig) -> tuple["LocalWorkers | RayWorkers", Router]:
    """The workers and the router in front of them; on Ray, supervised (restarted
    workers are wired back in, cluster/supervisor.py)."""
    workers = start(config)
    try:
        router = router_for(config, {w.name: w.address for w in workers.decode},
                            {w.name: w.address for w in workers.prefill})
        if config.launcher == "ray":
            from cluster.supervisor import RouterHooks

            workers.supervise(config.ray, RouterHooks(router.worker_down, router.worker_moved))
    except BaseException:
        workers.stop()
        raise
    return workers, router


class HTTPServer:
    """The router's HTTP endpoint, served by uvicorn from a thread (signals stay with
    whoever owns the main thread)."""

    def __init__(self, router: Router, host: str, port: int, timeout: float = 60.0) -> None:
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(router), host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="router", daemon=True)
        self.thread.start()
        end = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the router could not serve on {host}:{port} (port taken? see the log)")
            if time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"the router did not start serving on {host}:{port} within {timeout:g} s")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def wait_for_signal(still_running: Callable[[], bool]) -> None:
    """Until Ctrl-C or SIGTERM (or still_running() turns False)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5) and still_running():
        pass


def serve(config: ClusterConfig, detach: bool = False) -> None:
    """Serve until Ctrl-C (or SIGTERM), then stop the router and every worker. On Ray
    with detach=True, return once the deployment serves; `pdserve down` stops it."""
    if config.launcher == "ray":
        from cluster.ray_deployment import serve_on_ray

        serve_on_ray(config, detach)
        return
    if detach:
        raise ValueError("--detach needs launcher: ray (local workers end with this command)")
    workers, router = build(config)
    http = None
    # Exited workers are reported, routed around, and started again (as Ray does).
    supervisor = LocalSupervisor(config, workers, router.worker_down, router.worker_moved)
    try:
        http = HTTPServer(router, config.router.host, config.router.port)
        supervisor.start()
        print(f"pdserve: serving {config.model} at {http.url}/v1 ({len(workers.prefill)} prefill + "
              f"{len(workers.decode)} decode workers, {config.transport} transport, local launcher); "
              "Ctrl-C stops", flush=True)
        wait_for_signal(http.alive)
    finally:
        if http is not None:
            http.stop()
        supervisor.stop()  # first: workers stopped now are not restarted
        workers.stop()
        print("pdserve: stopped", flush=True)
