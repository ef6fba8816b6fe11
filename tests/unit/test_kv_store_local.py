"""The KV store's same-host socket (kv_store/local_endpoint.py): a worker on the store's
host puts and fetches over a Unix socket in the clear, which only this user can reach;
anywhere else, or when anything about the socket's directory is amiss, over CURVE TCP."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.local.kv_store import start_store
from engine.kv_cache.shared_tier import SharedBlock, StoreUnavailable
from kv_store import StoreClient, StoreServer, local_endpoint
from kv_store import client as client_module
from security import DeploymentSecret
from tests.unit.test_kv_store import store_config, wait_for

BLOCK = SharedBlock(11, 0, (1, 2), 99, b"kv" * 4096)


@pytest.fixture
def run_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The user's socket directory, in a test's own place: directly under /tmp, since a
    Unix socket's path holds at most 107 bytes and pytest's tmp_path under xdist is long
    enough for the socket's to pass that (the store would then serve over TCP only)."""
    parent = Path(tempfile.mkdtemp(prefix="pds-", dir="/tmp"))
    path = parent / "run"
    monkeypatch.setattr(local_endpoint, "run_dir", lambda: path)
    yield path
    shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture
def secret() -> DeploymentSecret:
    return DeploymentSecret.new()


@pytest.fixture
def server(run_dir: Path, secret: DeploymentSecret) -> Iterator[StoreServer]:
    s = StoreServer(1 << 20, "127.0.0.1", secret=secret).start()
    yield s
    s.stop()


def round_trip(client: StoreClient) -> bytes:
    client.open(5)
    client.put(BLOCK)
    wait_for(lambda: client.fetch([BLOCK.block_hash]) != [], "the put did not land")
    return bytes(client.fetch([BLOCK.block_hash])[0].data)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("same_host", [True, False])
def test_a_worker_on_the_stores_host_uses_its_unix_socket_and_any_other_curve(
        server: StoreServer, secret: DeploymentSecret, run_dir: Path, same_host: bool) -> None:
    client = StoreClient(server.address, secret, same_host=same_host)
    try:
        assert round_trip(client) == BLOCK.data
        if same_host:
            assert client.endpoint == server.local_address == f"ipc://{local_endpoint.socket_path(server.address, secret)}"
        else:
            assert client.endpoint == server.address
        assert server.refused == 0
    finally:
        client.close()
    assert local_endpoint.dir_problem(run_dir) is None and (run_dir.stat().st_mode & 0o777) == 0o700


@pytest.mark.timeout(30)
def test_another_deployments_worker_goes_over_tcp_and_is_refused(server: StoreServer) -> None:
    """Its secret names another socket (none there): it connects over TCP, where the
    CURVE keys refuse it, as before the same-host socket existed."""
    stranger = StoreClient(server.address, DeploymentSecret.new(), fetch_timeout_s=0.3)
    try:
        stranger.open(5)
        stranger.put(BLOCK)
        assert stranger.endpoint == server.address
        wait_for(lambda: server.refused > 0, "the stranger was not refused")
        assert server.store.used_bytes == 0
    finally:
        stranger.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to become another user")
def test_no_other_user_can_reach_the_socket(server: StoreServer) -> None:
    assert server.local_address is not None
    path = server.local_address.removeprefix("ipc://")
    pid = os.fork()
    if pid == 0:  # the child: nobody (65534) tries to connect
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
            code = 0
        except PermissionError:
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1, "another user reached the store's socket"


@pytest.mark.parametrize("unsafe", ["open to others", "another user's", "a file", "in a parent open to others",
                                    "no temporary directory"])
def test_an_unsafe_directory_is_not_used_by_the_store_nor_the_workers(
        run_dir: Path, secret: DeploymentSecret, unsafe: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if unsafe == "a file":
        run_dir.write_text("")
    elif unsafe == "in a parent open to others":  # not sticky: another user could swap the directory
        run_dir.parent.chmod(0o777)
    elif unsafe == "no temporary directory":  # tempfile.gettempdir() finds none writable
        def none() -> Path:
            raise FileNotFoundError("No usable temporary directory found")
        monkeypatch.setattr(local_endpoint, "run_dir", none)
    else:
        run_dir.mkdir(mode=0o700)
        if unsafe == "open to others":
            run_dir.chmod(0o755)
        elif os.geteuid() == 0:
            os.chown(run_dir, 65534, 65534)
        else:
            pytest.skip("needs root, to give the directory to another user")
    server = StoreServer(1 << 20, "127.0.0.1", secret=secret).start()
    client = StoreClient(server.address, secret)
    try:
        assert server.local_address is None
        assert round_trip(client) == BLOCK.data and client.endpoint == server.address  # over CURVE TCP
    finally:
        client.close()
        server.stop()


def test_a_socket_made_by_another_user_or_in_another_network_is_not_connected_to(
        server: StoreServer, secret: DeploymentSecret, monkeypatch: pytest.MonkeyPatch) -> None:
    assert local_endpoint.connect_path(server.address, secret) == server.local_address
    monkeypatch.setattr(local_endpoint, "_host_id", lambda: "another-boot:1")  # another host, or network namespace
    assert local_endpoint.connect_path(server.address, secret) is None
    monkeypatch.undo()
    if os.geteuid() == 0:
        assert server.local_address is not None
        os.chown(server.local_address.removeprefix("ipc://"), 65534, 65534)
        assert local_endpoint.connect_path(server.address, secret) is None


@pytest.mark.timeout(30)
def test_a_killed_stores_socket_file_is_replaced_and_a_stopped_ones_removed(
        run_dir: Path, secret: DeploymentSecret) -> None:
    first = StoreServer(1 << 20, "127.0.0.1", secret=secret).start()
    port = int(first.address.rpartition(":")[2])
    path = local_endpoint.socket_path(first.address, secret)
    client = StoreClient(first.address, secret, sync_interval_s=0.02)
    second = None
    try:
        assert round_trip(client) == BLOCK.data and client.endpoint == f"ipc://{path}"
        first.stop()
        assert not path.exists()
        path.write_text("")  # as a killed store leaves its socket file (a plain file here)
        second = StoreServer(1 << 20, "127.0.0.1", port, secret=secret).start()
        assert second.local_address == f"ipc://{path}"
        deadline = time.monotonic() + 10
        while second.store.used_bytes == 0:  # the client's socket reconnects to the new store's
            assert time.monotonic() < deadline, "no put reached the restarted store"
            client.put(BLOCK)
            time.sleep(0.05)
    finally:
        client.close()
        if second is not None:
            second.stop()


def test_the_socket_path_is_short_enough_for_any_host() -> None:
    """A Unix socket's path holds at most 107 bytes on Linux."""
    path = local_endpoint.socket_path("tcp://[fe80::1234:5678:9abc:def0:1234:5678]:65535", DeploymentSecret.new())
    assert len(str(path)) < 100, path


@pytest.mark.timeout(30)
def test_a_store_back_at_its_address_without_its_unix_socket_is_reached_over_tcp(
        run_dir: Path, secret: DeploymentSecret) -> None:
    """The client's I/O socket follows its sync socket there: it does not stay on the
    old path, where no store answers any more (white-box review, finding 2)."""
    first = StoreServer(1 << 20, "127.0.0.1", secret=secret).start()
    port = int(first.address.rpartition(":")[2])
    client = StoreClient(first.address, secret, fetch_timeout_s=0.3, sync_interval_s=0.05)
    second = None
    try:
        assert round_trip(client) == BLOCK.data and client.endpoint.startswith("ipc://")
        first.stop()
        second = StoreServer(1 << 20, "127.0.0.1", port, secret=secret, local=False).start()  # its ipc bind failed
        put_and_fetch_until_served(client)
        assert client.endpoint == second.address
    finally:
        client.close()
        if second is not None:
            second.stop()


@pytest.mark.timeout(30)
def test_a_socket_file_no_store_listens_on_is_given_up_for_tcp(
        run_dir: Path, secret: DeploymentSecret) -> None:
    """A file of the right name and owner with nothing behind it (left by a store that
    died and came back without its socket, or seen by a host that shares the directory)
    must not hold a worker off the store (white-box review, finding 3)."""
    server = StoreServer(1 << 20, "127.0.0.1", secret=secret, local=False).start()
    path = local_endpoint.socket_path(server.address, secret)
    run_dir.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(path))  # closed at once: a socket file nobody listens on
    client = StoreClient(server.address, secret, fetch_timeout_s=0.3, sync_interval_s=0.05)
    try:
        client.open(5)
        put_and_fetch_until_served(client)
        assert client.endpoint == server.address
    finally:
        client.close()
        server.stop()


def put_and_fetch_until_served(client: StoreClient, timeout: float = 15.0) -> None:
    """Put BLOCK and fetch it back until the store answers with it (puts are dropped and
    fetches fail while the client finds its way)."""
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, f"the store was not reached (client at {client.endpoint})"
        client.put(BLOCK)
        try:
            if client.fetch([BLOCK.block_hash]):
                return
        except StoreUnavailable:
            pass
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_after_a_stall_a_worker_goes_back_to_the_unix_socket(
        secret: DeploymentSecret, llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store stopped (SIGSTOP) longer than a sync's timeout: the worker moves to TCP,
    then back to the Unix socket once the store answers there again, instead of paying
    for CURVE for good (black-box review: a 1.5 s stall pinned workers to TCP). The store
    is a process of its own, as the launcher starts it, with the user's real directory."""
    monkeypatch.setattr(client_module, "PROBE_S", 0.5)
    store = start_store(store_config(llama_dir), secret)
    client = StoreClient(store.address, secret, fetch_timeout_s=0.3, sync_interval_s=0.05)
    seen = set()
    try:
        assert round_trip(client) == BLOCK.data and client.endpoint.startswith("ipc://")
        os.kill(store.process.pid, signal.SIGSTOP)
        time.sleep(1.5)
        os.kill(store.process.pid, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while not ("tcp" in seen and client.endpoint.startswith("ipc://")):
            assert time.monotonic() < deadline, f"endpoints seen {seen}, now {client.endpoint}"
            with contextlib.suppress(StoreUnavailable):
                client.fetch([BLOCK.block_hash])
            seen.add(client.endpoint[:3])
            time.sleep(0.05)
        put_and_fetch_until_served(client)
    finally:
        client.close()
        store.stop()
