"""The server a benchmark loads: a cluster started in this process (`pdserve serve`'s
code) and stopped on exit, or one already running at a URL."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import httpx2 as httpx

from benchmarks.serving.load import auth_headers

if TYPE_CHECKING:
    from cluster.config import ClusterConfig


@contextmanager
def serving(config: "str | ClusterConfig | None", url: str | None, model: str | None = None,
            port: int | None = None, api_key: str | None = None) -> Iterator[tuple[str, str]]:
    """(base URL, model name) of the server to load: with config (a path or a loaded
    ClusterConfig), that cluster started here and stopped on exit; else the one at url."""
    if config is None:
        url = url.rstrip("/")
        yield url, model or httpx.get(f"{url}/models", headers=auth_headers(api_key)).json()["data"][0]["id"]
        return
    import uvicorn

    from cluster.config import load_cluster_config
    from cluster.serve import build
    from router.app import create_app

    if isinstance(config, str):
        config = load_cluster_config(config)
    if port is not None:
        config = dataclasses.replace(config, router=dataclasses.replace(config.router, port=port))
    workers, router = build(config)
    server = None
    try:
        server = uvicorn.Server(uvicorn.Config(create_app(router), host=config.router.host,
                                               port=config.router.port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.05)
        yield f"http://{config.router.host}:{config.router.port}/v1", model or config.model
    finally:
        if server is not None:
            server.should_exit = True
        workers.stop()
