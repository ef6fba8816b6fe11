"""The store's same-host endpoint: a Unix socket beside its CURVE TCP socket.

Every block a worker writes through crosses to the store, and every block it loads comes
back. Over the TCP socket each byte is encrypted and decrypted by CURVE (about 0.8 ms of
CPU for a 737 KB block of the demo model on this machine, against 0.13 ms over a Unix
socket: docs/benchmarks/2026-12-05-kv-cache-hierarchy.md), on the cores that run the
model. A worker on the store's host therefore talks to it over the Unix socket, in the
clear.

That socket is authenticated by the operating system instead of by keys: it lives in a
directory that only this user can enter (created 0700, and used only while it is a real
directory owned by this user with no access for anyone else, checked by the store before
it binds and by each worker before it connects). So only processes of the user that runs
the deployment reach it, the same boundary as the shm transport's segments (0600) and as
the deployment's secret itself, which such a process could read from the workers' memory.
A worker on another host, or one that finds anything amiss with the directory, uses the
TCP socket and its CURVE keys, as before.

The socket's path is a digest of the store's TCP address (its host and port), of the
network namespace and of the deployment's public server key, so that:
- a worker holding that address finds it with no other setting, and a store restarted
  at the same address (the supervisor's, or Ray's) binds it again;
- processes that share a file system but not a network (containers with a common /tmp,
  the network namespaces that tests/multihost makes hosts of) do not meet through it:
  for them the store is on another host;
- a worker of another deployment (whose store's port this one took after that store
  died) looks elsewhere, goes over TCP, and is refused there by the CURVE keys, as it
  was before this socket existed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import tempfile
from pathlib import Path

from security import DeploymentSecret

logger = logging.getLogger(__name__)


def run_dir() -> Path:
    """This user's directory for pdserve's sockets (under the system's temporary directory)."""
    return Path(tempfile.gettempdir()) / f"pdserve-{os.geteuid()}"


def socket_path(tcp_address: str, secret: DeploymentSecret | None) -> Path:
    """Where the store at `tcp_address` (tcp://host:port) of the deployment with `secret`
    listens on this host, in this network namespace."""
    host, _, port = tcp_address.removeprefix("tcp://").rpartition(":")
    key = secret.server_public.decode() if secret is not None else "-"
    digest = hashlib.sha256(f"{host}|{port}|{_network()}|{key}".encode()).hexdigest()[:24]
    return run_dir() / f"kv-store-{digest}.sock"


def _network() -> int:
    """This process's network namespace (its inode), 0 where /proc does not say."""
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


def dir_problem(path: Path) -> str | None:
    """Why `path` cannot hold a socket only this user reaches, or None if it can."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.geteuid():
        return f"{path} belongs to user {st.st_uid}, not to this one ({os.geteuid()})"
    if st.st_mode & 0o077:
        return f"{path} is reachable by others (mode {stat.S_IMODE(st.st_mode):o}, not 700)"
    return None


def bind_path(tcp_address: str, secret: DeploymentSecret | None) -> str | None:
    """The store's side: the ipc:// endpoint to bind for `tcp_address`, with the directory
    made if missing and any file left at the path (a store that was killed) removed; None,
    with a warning, if the directory is not safe (the store then serves over TCP only)."""
    directory = run_dir()
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        logger.warning("KV store: no same-host socket (%s); workers reach it over TCP", exc)
        return None
    problem = dir_problem(directory)
    if problem is not None:
        logger.warning("KV store: no same-host socket: %s; workers reach it over TCP", problem)
        return None
    path = socket_path(tcp_address, secret)
    path.unlink(missing_ok=True)
    return f"ipc://{path}"


def connect_path(tcp_address: str, secret: DeploymentSecret | None) -> str | None:
    """A worker's side: the ipc:// endpoint of the store at `tcp_address` if it runs on
    this host (its socket is there, in a directory only this user reaches, and is this
    user's), else None: connect over TCP."""
    path = socket_path(tcp_address, secret)
    if dir_problem(path.parent) is not None:
        return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        return None
    return f"ipc://{path}"
