"""Whether a sender's process can still write: the fence's "the sender is gone" test.

A one-sided write (shm, cuda_ipc, nixl) lands without the receiver's involvement, so
the receiver keeps a dead reservation's blocks out of use until the sender says none
of its writes can land (cancel_ack), or until the sender's process no longer exists.
A pid alone does not say the second: pids are reused. A process is named by its pid
together with its start time (field 22 of /proc/<pid>/stat, in clock ticks since boot),
the host's boot id and the pid namespace it lives in; the receiver can check that name
only on the same host and in the same pid namespace, which is where shm and cuda_ipc
senders always are.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessId:
    """A process, told apart from any later one that reuses its pid."""

    pid: int
    start: int  # /proc/<pid>/stat field 22: clock ticks after boot
    boot: str  # /proc/sys/kernel/random/boot_id
    pidns: int  # inode of /proc/self/ns/pid: pids name processes only inside one namespace


def _read(path: str) -> bytes:
    """The file's bytes (a process's name in /proc/<pid>/stat need not be UTF-8)."""
    try:
        with open(path, "rb") as f:
            return f.read().strip()
    except OSError:
        return b""


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) of a running pid, or None if there is no such process."""
    data = _read(f"/proc/{pid}/stat")
    if not data:
        return None
    # The command name (field 2) is in parentheses and may hold spaces, ')' or any byte.
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return fields[0].decode("ascii", "replace"), int(fields[19])
    except (IndexError, ValueError):
        return None


@functools.cache
def _host() -> tuple[str, int]:
    """(boot id, pid namespace) of this process: what a pid is relative to. Read once:
    neither changes while the process runs."""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = 0
    return _read("/proc/sys/kernel/random/boot_id").decode("ascii", "replace"), pidns


def process_id(pid: int) -> ProcessId | None:
    """The name of process `pid` as it runs now, or None if none runs (a zombie counts
    as none)."""
    stat = _stat(pid)
    if stat is None or stat[0] in ("Z", "X"):
        return None
    return ProcessId(pid, stat[1], *_host())


def this_process() -> ProcessId:
    stat = _stat(os.getpid())
    return ProcessId(os.getpid(), stat[1] if stat else 0, *_host())


def is_gone(proc: ProcessId) -> bool | None:
    """True: the process has exited (a zombie counts: it runs no code and its mappings
    are gone); False: it still runs (maybe stopped); None: it cannot be told from here
    (another host or pid namespace, or no /proc)."""
    boot, pidns = _host()
    if not proc.boot or proc.boot != boot or not proc.pidns or proc.pidns != pidns or not proc.start:
        return None
    stat = _stat(proc.pid)
    if stat is None:
        return True
    state, start = stat
    return start != proc.start or state in ("Z", "X")
