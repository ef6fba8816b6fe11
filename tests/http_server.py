"""The router's FastAPI app served by uvicorn in a thread, for tests over real HTTP."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from router.app import Router, create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(router: Router, port: int, timeout: float = 30.0) -> Iterator[str]:
    """Serve `router` on 127.0.0.1:port until the block ends; yields the base URL."""
    http = uvicorn.Server(uvicorn.Config(create_app(router), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    try:
        end = time.monotonic() + timeout
        while not http.started:
            assert time.monotonic() < end and thread.is_alive(), "router did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        http.should_exit = True
        thread.join(10)
