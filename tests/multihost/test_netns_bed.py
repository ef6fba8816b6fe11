"""The multi-host test bed (benchmarks/netns_cluster/bed.py): hosts reach each other
only at their own addresses, a partition drops silently and heals, a rate limit
limits, and nothing it made outlives it: not at `down`, not after a crash (the next
bed sweeps it), not after a failed start."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import benchmarks.netns_cluster.bed as bed_module
from benchmarks.netns_cluster.__main__ import main as cli
from benchmarks.netns_cluster.bed import SHM_DIR, BedUnavailable, NetnsCluster, check_available
from tests.multihost.conftest import bed_or_skip

REPO = Path(__file__).resolve().parents[2]


class Echo:
    """A server on `host` that sends `size` bytes to each connection."""

    def __init__(self, bed: NetnsCluster, host: int, size: int = 2) -> None:
        with bed.inside(host):
            self.server = socket.create_server((bed.address(host), 0))
        self.address = (bed.address(host), self.server.getsockname()[1])
        self.payload = b"x" * size
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(self.payload)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # close() alone would not wake the accept()
            self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()


def fetch(bed: NetnsCluster, host: int, address: tuple[str, int], timeout: float = 1.0) -> bytes:
    with bed.inside(host):
        conn = socket.create_connection(address, timeout=timeout)
    with conn:
        data = b""
        while chunk := conn.recv(1 << 20):
            data += chunk
        return data


def namespaces_named(name: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{name}-")]


@pytest.mark.timeout(60)
def test_hosts_reach_each_other_and_a_partition_drops_silently_until_healed(bed3: NetnsCluster) -> None:
    echo = Echo(bed3, 3)
    try:
        assert fetch(bed3, 2, echo.address) == b"xx" and fetch(bed3, 1, echo.address) == b"xx"
        with bed3.inside(3):  # its own address, not the machine's loopback of another host
            assert socket.create_connection(echo.address, timeout=1).recv(2) == b"xx"
        bed3.partition(2, 3)
        start = time.monotonic()
        with pytest.raises(TimeoutError):  # dropped: no refusal, no error, only silence
            fetch(bed3, 2, echo.address)
        assert time.monotonic() - start >= 0.9
        assert fetch(bed3, 1, echo.address) == b"xx"  # other paths stay
        bed3.heal(2, 3)
        assert fetch(bed3, 2, echo.address) == b"xx"
    finally:
        echo.close()


@pytest.mark.timeout(60)
def test_cuts_are_per_pair_and_stay_while_other_links_change(bed3: NetnsCluster) -> None:
    echo = Echo(bed3, 2)
    try:
        bed3.partition(1, 2)
        bed3.partition(1, 2)  # twice: still one cut, healed by one heal
        bed3.partition(2, 3)
        bed3.limit(2, "50mbit")  # changed in place: the cuts on host 2's port stay
        bed3.heal(2, 3)
        bed3.heal(2, 3)  # not cut: nothing to do
        assert fetch(bed3, 3, echo.address) == b"xx"
        with pytest.raises(TimeoutError):
            fetch(bed3, 1, echo.address, timeout=0.5)
        bed3.limit(2, None)
        with pytest.raises(TimeoutError):
            fetch(bed3, 1, echo.address, timeout=0.5)
        bed3.heal(1, 2)
        assert fetch(bed3, 1, echo.address) == b"xx"
    finally:
        echo.close()


@pytest.mark.timeout(60)
def test_a_rate_limit_limits_both_directions(bed3: NetnsCluster) -> None:
    size = 1 << 20  # 8 Mbit: 0.5 s at 16 Mbit/s, milliseconds unlimited
    echo = Echo(bed3, 3, size)
    try:
        start = time.monotonic()
        assert len(fetch(bed3, 2, echo.address, timeout=10)) == size
        unlimited = time.monotonic() - start
        bed3.limit(2, "16mbit")  # what host 2 receives goes through the bridge's port to it
        start = time.monotonic()
        assert len(fetch(bed3, 2, echo.address, timeout=10)) == size
        limited = time.monotonic() - start
        bed3.partition(1, 2)  # the limit stays under a partition's shaping
        start = time.monotonic()
        assert len(fetch(bed3, 2, echo.address, timeout=10)) == size
        partitioned = time.monotonic() - start
    finally:
        echo.close()
    assert unlimited < 0.3 and limited > 0.4 and partitioned > 0.4, (unlimited, limited, partitioned)


@pytest.mark.timeout(60)
def test_down_leaves_no_namespace_process_shm_file_or_state() -> None:
    bed = bed_or_skip(2, suffix="d").up()
    shm = SHM_DIR / f"pdnet-test-{os.getpid()}"
    other = SHM_DIR / f"pdnet-test-{os.getpid()}-not-the-beds"
    try:
        sleeper = bed.popen(2, ["sleep", "600"])
        # a process of the host holding a shared-memory file, killed before it removes it
        holder = bed.popen(1, [sys.executable, "-c", f"import time; f = open({str(shm)!r}, 'w'); f.write('kv'); "
                                                     "f.flush(); print('made', flush=True); time.sleep(600)"],
                           stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "made"
        other.write_text("a file of this machine, made while the bed is up")
        assert sleeper.pid in bed.pids(2) and holder.pid in bed.pids(1)
    finally:
        bed.down()
    try:
        sleeper.wait(10)
        holder.wait(10)
        assert namespaces_named(bed.name) == [] and not bed.state_dir.exists() and not shm.exists()
        assert other.exists()  # not the bed's: kept
    finally:
        other.unlink(missing_ok=True)


@pytest.mark.timeout(60)
def test_a_crashed_beds_leftovers_are_swept_by_the_next_bed() -> None:
    check = bed_or_skip(1)  # skips without root
    # A bed whose owner died without `down` (the owner: a process that has exited).
    kept = NetnsCluster(f"{check.name}k", 1, owner=os.getpid()).up()  # its owner lives on: not touched
    gone = subprocess.Popen(["true"])
    gone.wait()
    crashed = NetnsCluster(f"{check.name}c", 2, owner=gone.pid).up()
    survivor = crashed.popen(1, ["sleep", "600"])
    try:
        fresh = NetnsCluster(f"{check.name}f", 1, owner=os.getpid()).up()
        fresh.down()
        survivor.wait(10)
        assert namespaces_named(crashed.name) == [] and not crashed.state_dir.exists()
        assert sorted(namespaces_named(kept.name)) == [f"{kept.name}-br", f"{kept.name}-h1"]
    finally:
        kept.down()
        crashed.down()


@pytest.mark.timeout(60)
def test_a_start_that_fails_half_way_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    bed = bed_or_skip(3, suffix="x")
    real, calls = bed_module._ip, []

    def failing(*args: str) -> None:
        calls.append(args)
        if len(calls) == 11:  # host 2's namespace exists, its link not yet
            raise KeyboardInterrupt
        real(*args)

    monkeypatch.setattr(bed_module, "_ip", failing)
    with pytest.raises(KeyboardInterrupt):
        bed.up()
    assert namespaces_named(bed.name) == [] and not bed.state_dir.exists()


def test_without_root_the_bed_refuses_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(BedUnavailable, match="need root"):
        check_available()
    assert cli(["up", "--hosts", "2", "--name", "pdnetnoroot"]) == 2
    assert "need root" in capsys.readouterr().err


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="name must be"):
        bed_module.teardown("..")  # never a path out of the beds' directory
    with pytest.raises(ValueError, match="hosts must be 1-200"):
        NetnsCluster("x", 0)
    with pytest.raises(ValueError, match="rate must end in"):
        NetnsCluster("x", 2, rate="fast")
    with pytest.raises(ValueError, match="name must be"):
        NetnsCluster("a b", 2)


@pytest.mark.timeout(60)
def test_the_cli_builds_and_removes_a_bed() -> None:
    name = bed_or_skip(1).name + "cli"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    up = subprocess.run([sys.executable, "-m", "benchmarks.netns_cluster", "up", "--hosts", "2", "--name", name],
                        cwd=REPO, capture_output=True, text=True, timeout=30, env=env)
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout.split() == [f"{name}-h1", "10.88.0.1", f"{name}-h2", "10.88.0.2"]
        assert sorted(namespaces_named(name)) == [f"{name}-br", f"{name}-h1", f"{name}-h2"]
    finally:
        down = subprocess.run([sys.executable, "-m", "benchmarks.netns_cluster", "down", "--name", name],
                              cwd=REPO, capture_output=True, text=True, timeout=30, env=env)
    assert down.returncode == 0 and namespaces_named(name) == []
