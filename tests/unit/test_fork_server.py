"""The local workers' fork server (cluster/local/fork_server.py): a worker starts with
torch and the roles' modules already imported, and in the launcher's environment as it
is at the worker's start, not as it was when the server started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection

import pytest

from cluster.local.fork_server import in_environment, worker_context

KEY = "PDSERVE_TEST_FORK_SERVER"


def report(conn: Connection) -> None:
    conn.send_bytes(json.dumps({"value": os.environ.get(KEY), "torch": "torch" in sys.modules,
                                "roles": "decode_worker.server" in sys.modules and "prefill_worker.server" in sys.modules,
                                }).encode())


def start_one() -> dict[str, object]:
    ctx = worker_context()
    parent, child = ctx.Pipe()
    process = ctx.Process(target=in_environment, args=(dict(os.environ), report, child), daemon=True)
    process.start()
    child.close()
    try:
        assert parent.poll(60), "the forked process did not report"
        return json.loads(parent.recv_bytes())
    finally:
        process.join(10)
        assert process.exitcode == 0


def test_a_worker_gets_the_environment_of_its_start_and_the_preloaded_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY, "first")
    first = start_one()  # starts the server, if nothing in this process did yet
    monkeypatch.setenv(KEY, "second")
    second = start_one()
    monkeypatch.delenv(KEY)
    third = start_one()
    assert (first["value"], second["value"], third["value"]) == ("first", "second", None)
    # imported by the server before the fork: the worker does not import them itself
    assert first["torch"] and first["roles"]


LAUNCHER = """
import os, signal, time
from cluster.local.fork_server import in_environment, worker_context
ctx = worker_context()
worker = ctx.Process(target=in_environment, args=(dict(os.environ), time.sleep, 60), daemon=True)
worker.start()
signal.signal(signal.SIGTERM, lambda *_: None)  # the launcher catches it, as pdserve serve does
print("started", flush=True)
worker.join(60)
print(worker.exitcode, flush=True)
"""


def test_a_sigterm_to_the_process_group_reaches_the_worker_as_sigterm() -> None:
    """`timeout` or systemd signal the launcher's whole group: the worker's exit code is
    -SIGTERM (what the supervisor takes for a shutdown), not the 255 of a lost server."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER], cwd=root, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": root}, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert out.strip() == str(-signal.SIGTERM)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


ORPHANING = """
import os, signal, time
from cluster.local.fork_server import ForkedProcess, in_environment, worker_context
ctx = worker_context()
def start():
    process = ctx.Process(target=in_environment, args=(dict(os.environ), time.sleep, 60), daemon=True)
    process.start()
    return process
raw = start()
worker = ForkedProcess(raw)
server = int(open(f"/proc/{worker.pid}/stat").read().rpartition(")")[2].split()[1])  # its parent
os.kill(server, signal.SIGKILL)
raw.join(10)  # returns once multiprocessing takes the worker for exited
print(raw.exitcode, worker.is_alive(), worker.exitcode, flush=True)
worker.kill()
worker.join(10)
gone = not os.path.exists(f"/proc/{worker.pid}") or open(f"/proc/{worker.pid}/stat").read().rpartition(")")[2].split()[0] == "Z"
print(worker.is_alive(), gone, flush=True)
again = ForkedProcess(start())  # a restart starts a new server
print(again.is_alive(), flush=True)
again.kill()
again.join(10)
print(again.is_alive(), again.exitcode, flush=True)
"""


def test_a_worker_whose_fork_server_died_is_still_seen_running_and_can_be_killed() -> None:
    """multiprocessing takes every worker of a dead fork server for exited with 255 and
    stops signalling it; the supervisor would report them all down and start second
    copies beside them. ForkedProcess asks the kernel."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", ORPHANING], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": root}, start_new_session=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:4] == ["255 True None", "False True", "True", f"False {-signal.SIGKILL}"]


def start_stopped_child(conn: Connection) -> None:
    """A TP driver whose follower rank is stopped (SIGSTOP): it cannot notice its driver gone."""
    child = subprocess.Popen([sys.executable, "-c", "import os, signal, time; os.kill(os.getpid(), signal.SIGSTOP); "
                              "time.sleep(120)"])
    conn.send_bytes(str(child.pid).encode())
    time.sleep(120)


@pytest.mark.timeout(60)
def test_kill_group_takes_a_stopped_follower_with_its_worker() -> None:
    from cluster.local.fork_server import ForkedProcess, process_id

    ctx = worker_context()
    parent, child = ctx.Pipe()
    process = ctx.Process(target=in_environment, args=(dict(os.environ), start_stopped_child, child), daemon=True)
    process.start()
    worker = ForkedProcess(process)
    assert parent.poll(30)
    follower = int(parent.recv_bytes())
    deadline = time.monotonic() + 10
    while (identity := process_id(follower)) is None or open(f"/proc/{follower}/stat").read().split(")")[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the follower never stopped"
        time.sleep(0.05)
    worker.kill_group()  # kill() alone left the follower stopped, orphaned, for good
    worker.join(10)
    deadline = time.monotonic() + 10
    while process_id(follower) is not None:
        assert time.monotonic() < deadline, "the stopped follower outlived its worker"
        time.sleep(0.05)
    assert not worker.is_alive() and identity is not None
