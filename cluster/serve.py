"""`pdserve serve CONFIG`: the workers and the router in front of them.

The config's launcher (cluster/launcher.py) starts and supervises the workers and
serves: with `launcher: local` the workers are processes and the router runs here
(cluster/local/launcher.py); with `launcher: ray` all of it runs in a deployment actor
on this node (cluster/ray/deployment.py), which this command starts and, unless
detached, stops.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn

from cluster.config import ClusterConfig
from cluster.elastic import scaler_for
from cluster.http_protocol import with_header_deadline
from cluster.launcher import RouterHooks, Workers, launcher_for
from engine.model.config import ModelConfig, max_model_len
from engine.speculative.draft_check import check_draft
from engine.tokenizer import TOKENIZER_FILES, has_tokenizer
from router.app import Router, create_app
from router.config import ModelLimits
from security import DeploymentSecret

logger = logging.getLogger(__name__)


def router_for(config: ClusterConfig, decode_workers: dict[str, str],
               prefill_workers: dict[str, str] | None = None, secret: DeploymentSecret | None = None) -> Router:
    """The router in front of these workers (name -> address): the config's router
    section, the limits of the model as the decode workers' engines will have them, and
    their deployment's secret (None: workers without one, in tests)."""
    return Router(config.router, ModelLimits.of(config.engine_config("decode")), decode_workers, prefill_workers,
                  secret, config.lora.adapters if config.lora is not None else {})


def build(config: ClusterConfig) -> tuple[Workers, Router]:
    """The config's workers, started by its launcher (each with .name and .address),
    and the router in front of them. Workers that Ray restarts are supervised at once
    (a restart is wired back in, cluster/ray/supervisor.py); local ones only by
    `serve`, once it serves. Raises ValueError, before any worker starts, for a model
    directory the router cannot serve text from."""
    check_servable(config)
    launcher = launcher_for(config)
    workers = launcher.start(config)
    try:
        router = router_for(config, {w.name: w.address for w in workers.decode},
                            {w.name: w.address for w in workers.prefill}, workers.secret)
        router.scaler = scaler_for(config, launcher.pools(config, workers), router.control)
        if launcher.restarts_workers:
            launcher.supervise(config, workers, RouterHooks.of(router.control))
    except BaseException:
        workers.stop()
        raise
    return workers, router

def check_servable(config: ClusterConfig) -> None:
    """What would otherwise fail only once every worker has loaded: the router reads
    prompts and writes text with the model directory's tokenizer."""
    if Path(config.model).is_dir() and not has_tokenizer(config.model):
        raise ValueError(f"model {config.model!r} has no tokenizer ({', '.join(TOKENIZER_FILES)}): the router "
                         "needs one to read prompts and write text (with load_format dummy too: put the "
                         "tokenizer's files beside its config.json)")
    engine = config.engine_config("decode")
    spec = engine.speculative_config
    if spec is not None and spec.method == "draft_model" and (Path(config.model) / "config.json").is_file():
        target = ModelConfig.from_model_dir(config.model)
        try:
            check_draft(engine, target, max_model_len(engine, target))
        except ValueError as exc:  # else every decode worker fails the same way once started
            raise ValueError(f"decode.engine.{exc}") from None


def check_port_free(host: str, port: int) -> None:
    """router.host:port can be bound now (as uvicorn binds it), so that a port in use is
    said before the workers spend their time loading."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ValueError(f"router.port {port} on {host} cannot be bound: {exc.strerror or exc} "
                             "(another server there? pass --port)") from None


class HTTPServer:
    """The router's HTTP endpoint, served by uvicorn from a thread (signals stay with
    whoever owns the main thread)."""

    def __init__(self, router: Router, host: str, port: int, timeout: float = 60.0) -> None:
        self.url = f"http://{host}:{port}"
        # router.body_timeout_s bounds a request's headers here, and its body in the app;
        # a body answered before it was all read is drained up to twice the cap, so that
        # a client sending one that large whole reads the 413, not a reset.
        protocol = with_header_deadline(router.config.body_timeout_s, 2 * router.config.max_body_bytes)
        self.server = uvicorn.Server(uvicorn.Config(create_app(router), host=host, port=port, log_level="warning",
                                                    http=protocol))
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
    """Serve until Ctrl-C (or SIGTERM), then stop the router and every worker. With
    detach=True (a detachable launcher: Ray), return once the deployment serves;
    `pdserve down` stops it."""
    launcher_for(config).serve(config, detach)
