"""The router served over real HTTP for tests, by the same HTTPServer `pdserve serve` uses."""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from cluster.serve import HTTPServer
from router.app import Router

# A port found free here is bound later (by the router, a Ray head), so a port the kernel
# might hand out meanwhile could be taken first: the kernel's ephemeral range (32768 and
# up, also ZeroMQ's random ports) is avoided. Each pytest-xdist worker takes its own
# slice below it, so two workers never pick the same port.
_SLICE = 500
_BASE = 20000 + _SLICE * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_next = _BASE + random.randrange(_SLICE)  # another session on this host likely starts elsewhere


def free_port() -> int:
    """A port of this worker's slice that nothing listens on now."""
    global _next
    for _ in range(_SLICE):
        port, _next = _next, _BASE + (_next + 1 - _BASE) % _SLICE
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_BASE}..{_BASE + _SLICE - 1}")


@contextmanager
def serving(router: Router, port: int, timeout: float = 30.0) -> Iterator[str]:
    """Serve `router` on 127.0.0.1:port until the block ends (as `pdserve serve` does);
    yields the base URL."""
    http = HTTPServer(router, "127.0.0.1", port, timeout)
    try:
        yield http.url
    finally:
        http.stop()
