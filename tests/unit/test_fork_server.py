"""The local workers' fork server (cluster/local/fork_server.py): a worker starts with
torch and the roles' modules already imported, and in the launcher's environment as it
is at the worker's start, not as it was when the server started."""

from __future__ import annotations

import json
import os
import sys
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
