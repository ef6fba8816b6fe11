"""The store's same-host endpoint: a Unix socket beside its CURVE TCP socket.

Every block a worker writes through crosses to the store, and every block it loads comes
back. Over the TCP socket each byte is encrypted and decrypted by CURVE: a 720 KB block
of the demo model took 1.5 ms of CPU to put (worker and store together), against 0.5 ms
over a Unix socket (docs/benchmarks/2026-12-05-kv-cache-hierarchy.md), on the cores that
run the model. A worker on the store's host therefore talks to it over the Unix socket, in the
clear.

That socket is authenticated by the operating system instead of by keys: it lives in a
directory that only this user can enter (created 0700, and used only while it is a real
directory owned by this user with no access for anyone else, in a parent that no other
user can rename it out of: owned by root or this user, and sticky or not writable by
others, as /tmp is; checked by the store before it binds and by each worker whenever it
connects), and the socket itself is made 0600. So only processes of the user that runs
the deployment reach it: the same boundary as the shm transport's segments (0600), which
hold the KV bytes themselves. A worker on another host, or one that finds anything amiss
with the directory, uses the TCP socket and its CURVE keys, as before.

The socket's path is a digest of the store's TCP address (its host and port), of the
host's boot id and network namespace and of the deployment's public server key, so that:
- a worker holding that address finds it with no other setting, and a store restarted
  at the same address (the supervisor's, or Ray's) binds it again;
- processes that share a file system but not a host (a temporary directory on NFS) or
  not a network (containers with a common /tmp, the network namespaces that
  tests/multihost makes hosts of) do not meet through it: for them the store is on
  another host;
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
    """This user's directory for pdserve's sockets (under the system's temporary
    directory; OSError if there is none usable)."""
    return Path(tempfile.gettempdir()) / f"pdserve-{os.geteuid()}"


def socket_path(tcp_address: str, secret: DeploymentSecret | None) -> Path:
    """Where the store at `tcp_address` (tcp://host:port) of the deployment with `secret`
    listens on this host, in this network namespace (OSError: run_dir)."""
    host, _, port = tcp_address.removeprefix("tcp://").rpartition(":")
    key = secret.server_public.decode() if secret is not None else "-"
    digest = hashlib.sha256(f"{host}|{port}|{_host_id()}|{key}".encode()).hexdigest()[:24]
    return run_dir() / f"kv-store-{digest}.sock"


def _host_id() -> str:
    """This boot of this host, and this process's network namespace: the kernel's numbers
    for the initial namespace are the same on every host, its boot id is not."""
    parts = []
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    except OSError:
        parts.append("-")
    try:
        parts.append(str(os.stat("/proc/self/ns/net").st_ino))
    except OSError:
        parts.append("-")
    return ":".join(parts)


def dir_problem(path: Path) -> str | None:
    """Why `path` cannot hold a socket only this user reaches, or None if it can: it must
    be a directory of this user's that no one else may enter, in a parent from which no
    other user can rename it (owned by root or this user; sticky, or closed to others)."""
    me = os.geteuid()
    try:
        st, parent = os.lstat(path), os.stat(path.parent)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != me:
        return f"{path} belongs to user {st.st_uid}, not to this one ({me})"
    if st.st_mode & 0o077:
        return f"{path} is reachable by others (mode {stat.S_IMODE(st.st_mode):o}, not 700)"
    if parent.st_uid not in (0, me) or (parent.st_mode & 0o022 and not parent.st_mode & stat.S_ISVTX):
        return (f"{path.parent} lets another user replace {path.name} (owner {parent.st_uid}, "
                f"mode {stat.S_IMODE(parent.st_mode):o}, not sticky)")
    return None


def bind_path(tcp_address: str, secret: DeploymentSecret | None) -> str | None:
    """The store's side: the ipc:// endpoint to bind for `tcp_address`, with the directory
    made if missing and any file left at the path (a store that was killed) removed; None,
    with a warning, if there is no safe place for it (the store then serves over TCP only).
    After the bind, make_private() the socket file."""
    try:
        directory = run_dir()
        directory.mkdir(mode=0o700, exist_ok=True)
        problem = dir_problem(directory)
        if problem is None:
            path = socket_path(tcp_address, secret)
            path.unlink(missing_ok=True)
            return f"ipc://{path}"
    except OSError as exc:
        problem = str(exc)
    logger.warning("KV store: no same-host socket: %s; workers reach it over TCP", problem)
    return None


def make_private(endpoint: str) -> None:
    """The bound socket's file, 0600 (the directory already keeps others out: twice)."""
    os.chmod(endpoint.removeprefix("ipc://"), 0o600)


def connect_path(tcp_address: str, secret: DeploymentSecret | None) -> str | None:
    """A worker's side: the ipc:// endpoint of the store at `tcp_address` if it runs on
    this host (its socket is there, this user's, in a directory only this user reaches),
    else None: connect over TCP."""
    try:
        path = socket_path(tcp_address, secret)
        if dir_problem(path.parent) is not None:
            return None
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        return None
    return f"ipc://{path}"
