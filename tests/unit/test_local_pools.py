"""LocalPools (the local launcher's elastic pools) with fake processes, no model: what a
worker added at runtime is told when the other pool changes while it starts."""

from __future__ import annotations

import pytest

import cluster.local.elastic as elastic
import cluster.local.supervisor as supervision
from cluster.config import ClusterConfig
from cluster.local.workers import LocalWorkers, Worker
from protocol import CONTROL_MESSAGES, Peers
from tests.unit.test_local_supervisor import Control, Process

CONFIG = ClusterConfig.from_dict({"model": "/nonexistent"})


def worker(name: str, address: str = "") -> Worker:
    return Worker(name, Process(), Control(), address or f"tcp://{name}", b"")


def peers(w: Worker) -> list[Peers]:
    return [m for m in map(CONTROL_MESSAGES.decode, w.control.sent) if isinstance(m, Peers)]


@pytest.fixture
def no_console(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(elastic.console, "worker_ready", lambda *a: None)
    monkeypatch.setattr(supervision.console, "worker_back", lambda *a: None)


def test_a_worker_added_while_the_other_pool_restarts_one_learns_the_restart(monkeypatch, no_console) -> None:
    """decode-1 gets its first peers while prefill-0 is down; prefill-0's restart is wired
    in before decode-1 serves (the restart's tell_peers misses decode-1, not in its pool
    yet): decode-1 must still end up with prefill-0 as a peer."""
    workers = LocalWorkers(decode=[worker("decode-0")], prefill=[worker("prefill-0")])
    supervisor = supervision.LocalSupervisor(CONFIG, workers, lambda name: None, lambda name, address: None)
    dead = workers.prefill[0]
    workers.gone.add(dead.name)  # down, being restarted
    added = worker("decode-1")

    def serving(w: Worker, timeout: float) -> None:  # meanwhile, prefill-0's restart completes
        monkeypatch.setattr(supervision, "spawn", lambda *a: worker("prefill-0", "tcp://prefill-0-back"))
        monkeypatch.setattr(supervision, "await_ready", lambda w, timeout: None)
        monkeypatch.setattr(supervision, "await_serving", lambda w, timeout: None)
        assert supervisor._start(dead)

    monkeypatch.setattr(elastic, "spawn", lambda *a: added)
    monkeypatch.setattr(elastic, "await_ready", lambda w, timeout: None)
    monkeypatch.setattr(elastic, "await_serving", serving)
    elastic.LocalPools(CONFIG, workers).add_worker("decode")
    assert peers(added)[0].prefill == {}  # its first: prefill-0 was down
    assert peers(added)[-1].prefill == {"prefill-0": "tcp://prefill-0-back"}
    assert [w.name for w in workers.decode] == ["decode-0", "decode-1"]


def test_a_shutdown_while_a_worker_is_added_stops_it_and_adds_nothing(monkeypatch, no_console) -> None:
    """The deployment stops while decode-1 loads (it is in no pool yet): the stop must
    reach it, and add_worker must not put it in a pool of a stopped deployment."""
    workers = LocalWorkers(decode=[worker("decode-0")], prefill=[worker("prefill-0")])
    added = worker("decode-1")
    monkeypatch.setattr(elastic, "spawn", lambda *a: added)
    monkeypatch.setattr(elastic, "await_ready", lambda w, timeout: workers.stop())  # Ctrl-C meanwhile
    monkeypatch.setattr(elastic, "await_serving", lambda w, timeout: None)
    pools = elastic.LocalPools(CONFIG, workers)
    with pytest.raises(RuntimeError, match="the deployment stopped while decode-1 started"):
        pools.add_worker("decode")
    assert not added.process.is_alive() and [w.name for w in workers.all] == ["decode-0", "prefill-0"]
    assert workers.starting == []
    with pytest.raises(RuntimeError, match="the deployment is stopping: no prefill worker is added"):
        pools.add_worker("prefill")


def test_a_prefill_worker_scaled_away_has_exited_when_the_decode_workers_learn_it_is_gone() -> None:
    """They release the blocks it was writing and prefill locally in them: only a sender
    that has exited can write there no more (its writes' notifications, on a socket they
    drop, would never tell them it did)."""
    workers = LocalWorkers(decode=[worker("decode-0")], prefill=[worker("prefill-0"), worker("prefill-1")])
    leaving = workers.prefill[1]
    told: list[tuple[dict, bool]] = []  # (prefill peers decode-0 was told, prefill-1 running then)
    send = workers.decode[0].control.send_bytes

    def watch(data: bytes) -> None:
        send(data)
        told.append((CONTROL_MESSAGES.decode(data).prefill, leaving.process.is_alive()))
    workers.decode[0].control.send_bytes = watch  # type: ignore[method-assign]  # a spy on one pipe
    elastic.LocalPools(CONFIG, workers).remove_worker("prefill-1", 0.01)
    assert told == [({"prefill-0": "tcp://prefill-0"}, False)]
    assert [w.name for w in workers.prefill] == ["prefill-0"]
