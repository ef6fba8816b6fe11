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

A worker is the server's child, not the launcher's: the launcher learns its exit from
the server. Should the server die alone (the OOM killer, a stray kill), multiprocessing
takes every worker for exited with 255, and will not signal them any more, while they
all still run. ForkedProcess therefore asks the kernel, by pid, before it takes a worker
for exited, and signals it by pid.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from typing import Any

from kv_transfer.liveness import is_gone, process_id

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


# What multiprocessing reports for a forked process whose fork server is gone (and for
# one that really exited with 255: the kernel tells them apart).
_SERVER_LOST = 255


class ForkedProcess:
    """A started worker process of the fork server: is_alive, exitcode, kill and join as
    on multiprocessing's Process, right also after the fork server died."""

    def __init__(self, process: BaseProcess) -> None:
        if process.pid is None:
            raise ValueError("ForkedProcess wraps a started process")
        self._process = process
        self.pid: int = process.pid
        self.name = process.name
        self._identity = process_id(process.pid)  # pid and start time: tells a reused pid from it

    @property
    def exitcode(self) -> int | None:
        """None while it runs; 255 also where it exited after its fork server, whose
        exit status nobody can learn."""
        return None if self.is_alive() else self._process.exitcode

    @property
    def exit_known(self) -> bool:
        """Whether exitcode is its real exit status (not a lost server's 255; a real
        255 reads as unknown too)."""
        return self._process.exitcode != _SERVER_LOST

    def is_alive(self) -> bool:
        if self._process.is_alive():
            return True
        if self._process.exitcode != _SERVER_LOST:
            return False  # its exit status, from the server: it exited
        return self._identity is not None and is_gone(self._identity) is False

    def kill(self) -> None:
        """SIGKILL, by pid (multiprocessing's kill does nothing once it took the
        process for exited)."""
        if self.is_alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill_group(self) -> None:
        """SIGKILL it and every process it started: a tensor-parallel worker's follower
        ranks end when they see their driver gone, but a stopped or wedged one never
        looks (and would hold its memory, on a GPU its device memory, for good)."""
        group = descendants(self.pid) if self.is_alive() else []
        self.kill()
        for pid in group:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def join(self, timeout: float | None = None) -> None:
        end = None if timeout is None else time.monotonic() + timeout
        self._process.join(timeout)  # returns at once if the server is gone
        while self.is_alive() and (end is None or time.monotonic() < end):
            time.sleep(0.05)  # not our child: no wait() to block in



def descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs, as /proc shows them now (none without it)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # after the name, which may hold anything
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
