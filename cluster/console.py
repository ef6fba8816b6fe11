"""What `pdserve serve` says while it runs, besides its own prints: a line per worker as
it starts loading and when it is ready (or back after a restart), on the
`pdserve.startup` logger, and the router's access log (`pdserve.access`,
router/access_log.py). Both sit under the `pdserve` logger, which `configure()` sends to
stderr at INFO in the process that starts the workers or runs the router; a program
that embeds them configures logging itself and gets the same records.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from engine.config import EngineConfig

ROOT = "pdserve"
startup = logging.getLogger(f"{ROOT}.startup")

FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


def configure(level: int = logging.INFO) -> None:
    """Send the `pdserve` loggers' records to stderr (once per process; again is a no-op)."""
    logger = logging.getLogger(ROOT)
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        logger.addHandler(handler)
    logger.setLevel(level)


class _Stderr(logging.StreamHandler):
    """To sys.stderr as it is when a record comes (as logging's own last resort does),
    not as it was when configured: a redirection or a test's capture in between."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


def worker_starting(name: str, engine: EngineConfig) -> None:
    """A worker process (or Ray actor) was started and now loads its model."""
    role = name.rsplit("-", 1)[0]
    startup.info("%s: starting (%s worker): model %s%s, device %s, tensor parallel size %d", name, role,
                 engine.model, f" (dummy weights, from seed {engine.seed})" if engine.load_format == "dummy" else "",
                 engine.device, engine.tensor_parallel_size)


def worker_ready(name: str, address: str, seconds: float) -> None:
    """The worker said ready (model loaded, sockets bound), `seconds` after it was started."""
    startup.info("%s: ready at %s after %.1f s", name, address, seconds)


def worker_back(name: str, address: str, seconds: float, restart: int, max_restarts: int) -> None:
    """A restarted worker serves again (its peers and the router know it)."""
    startup.info("%s: back in service at %s, %.1f s after restart %d of %d", name, address, seconds,
                 restart, max_restarts)
