"""The router served over real HTTP for tests, by the same HTTPServer `pdserve serve` uses."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

from cluster.serve import HTTPServer
from router.app import Router


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(router: Router, port: int, timeout: float = 30.0) -> Iterator[str]:
    """Serve `router` on 127.0.0.1:port until the block ends (as `pdserve serve` does);
    yields the base URL."""
    http = HTTPServer(router, "127.0.0.1", port, timeout)
    try:
        yield http.url
    finally:
        http.stop()
