"""The shared KV store as a process of its own (the local launcher's; cluster/local/kv_store.py)."""

from __future__ import annotations

import logging
import time
from multiprocessing.connection import Connection

import zmq

from kv_store.server import StoreServer
from security import DeploymentSecret

logger = logging.getLogger(__name__)

BIND_RETRY_S = 0.1  # between two tries to bind a port in use


def serve_store(capacity_bytes: int, host: str, secret: DeploymentSecret | None, control: Connection,
                port: int = 0, bind_timeout_s: float = 0.0) -> None:
    """Serve until the launcher says stop (any message) or its end of `control` closes;
    the store's address goes to the launcher first. `port` 0: any free one; another is
    tried for up to `bind_timeout_s` while it is in use (bind_store)."""
    server = bind_store(capacity_bytes, host, port, secret, bind_timeout_s).start()
    try:
        control.send(server.address)
        logger.info("KV store serving at %s, %.2f GiB", server.address, capacity_bytes / 2**30)
        try:
            control.recv()
        except EOFError:
            pass
    finally:
        server.stop()


def bind_store(capacity_bytes: int, host: str, port: int, secret: DeploymentSecret | None,
               timeout_s: float) -> StoreServer:
    """A StoreServer on host:port, tried again while the port is in use, until `timeout_s`
    passed (then the ZMQError is raised). A store restarted where a killed one listened
    can find its port held a moment: a socket of another process that took it, or a
    worker's socket reconnecting to it that the kernel gave that very port (a TCP
    self-connect, until ZMQ's handshake fails and drops it)."""
    end = time.monotonic() + timeout_s
    said = False
    while True:
        try:
            return StoreServer(capacity_bytes, host, port, secret=secret)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() >= end:
                raise
            if not said:  # once: the tries that follow say nothing new
                logger.info("KV store: %s:%d is in use; trying again for up to %.1f s", host, port, timeout_s)
                said = True
        time.sleep(BIND_RETRY_S)
