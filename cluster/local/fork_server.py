"""Where the local launcher's worker processes come from: a fork server that has
imported torch and both roles' modules once.

A spawned worker imports them afresh before it loads its model: 2.2-2.4 CPU-seconds on
one core of the 2-core CI machine, paid again by every restart and every worker an
elastic pool adds. The fork server (multiprocessing's "forkserver") is a fresh process
of its own, started by the first worker: it never runs the router's threads, so a fork
of it is as safe as a spawn. It outlives a SIGTERM to the process group
(server_signals.py). The launcher's process still imports neither torch nor the
engine.

A forked worker would see the fork server's environment, which is the launcher's as it
was when the server started. So each worker gets the launcher's environment as it is
when the worker starts, as a spawned one would (a test's fault injection or a user's
setting made after the first start reaches it).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from multiprocessing.context import ForkServerContext
from typing import Any

# Imported once, by the fork server, before it forks any worker. A process has one fork
# server: the list is set when this module is imported, and whoever else forks from the
# server in this process sets a list that includes it (tests/kv_transfer/conftest.py).
# It takes effect when the server starts; a module left out is imported by each worker.
PRELOAD = ["cluster.local.server_signals", "torch", "decode_worker.server", "prefill_worker.server"]
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


def worker_context() -> ForkServerContext:
    """The context whose Process and Pipe start workers."""
    return _CONTEXT


def in_environment(environ: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    """The worker's entry point: run `target(*args)` in the launcher's environment
    `environ` (its os.environ when it started this worker), with SIGTERM's default
    action back (the server ignores it: cluster/local/server_signals.py)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(environ)
    target(*args)
