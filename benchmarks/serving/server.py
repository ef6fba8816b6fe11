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


class ServerError(Exception):
    """The server to load cannot be used (not there, or it refuses us): a one-line reason."""


def server_model(url: str, api_key: str | None = None) -> str:
    """The first model the server at url (ending in /v1) lists: a check, before any load,
    that it answers and takes our key. ServerError if not."""
    try:
        response = httpx.get(f"{url}/models", headers=auth_headers(api_key), timeout=30.0)
    except httpx.HTTPError as exc:
        raise ServerError(f"no server answers at {url}: {type(exc).__name__}: {exc}") from None
    if response.status_code in (401, 403):
        raise ServerError(f"the server at {url} needs an API key: set PDSERVE_API_KEY" if api_key is None else
                          f"the server at {url} refuses the key in PDSERVE_API_KEY (HTTP {response.status_code})")
    try:
        return response.raise_for_status().json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ServerError(f"{url}/models did not list a model (HTTP {response.status_code}: "
                          f"{response.text[:200]!r}): is it an OpenAI-style API? ({type(exc).__name__})") from None


@contextmanager
def serving(config: str | ClusterConfig | None, url: str | None, model: str | None = None,
            port: int | None = None, api_key: str | None = None) -> Iterator[tuple[str, str]]:
    """(base URL, model name) of the server to load: with config (a path or a loaded
    ClusterConfig), that cluster started here and stopped on exit; else the one at url.
    Either is asked for its models first: ServerError if it does not answer or wants
    another key."""
    if config is None:
        url = url.rstrip("/")
        listed = server_model(url, api_key)
        yield url, model or listed
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
        url = f"http://{config.router.host}:{config.router.port}/v1"
        server_model(url, api_key)  # a config with api_keys needs PDSERVE_API_KEY too
        yield url, model or config.model
    finally:
        if server is not None:
            server.should_exit = True
        workers.stop()
