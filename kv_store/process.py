"""The shared KV store as a process of its own (the local launcher's; cluster/local/kv_store.py)."""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection

from kv_store.server import StoreServer
from security import DeploymentSecret

logger = logging.getLogger(__name__)


def serve_store(capacity_bytes: int, host: str, secret: DeploymentSecret | None, control: Connection) -> None:
    """Serve until the launcher says stop (any message) or its end of `control` closes;
    the store's address goes to the launcher first."""
    server = StoreServer(capacity_bytes, host, secret=secret).start()
    try:
        control.send(server.address)
        logger.info("KV store serving at %s, %.2f GiB", server.address, capacity_bytes / 2**30)
        try:
            control.recv()
        except EOFError:
            pass
    finally:
        server.stop()
