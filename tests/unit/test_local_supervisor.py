"""LocalSupervisor's bookkeeping with fake processes (no model loads): deaths are
reported while a restart is still loading, failed starts are stopped and retried up to
max_restarts, and a shutdown stops a worker still starting. The real restarts run in
tests/disagg/test_local_supervision.py."""

from __future__ import annotations

import logging
import threading
import time

import pytest

import cluster.local.supervisor as supervision
import cluster.local.workers as local
from cluster.local.workers import LocalWorkers, Worker
from security import DeploymentSecret


class Process:
    def __init__(self, alive: bool = True) -> None:
        self.alive, self.exitcode = alive, None

    def is_alive(self) -> bool:
        return self.alive

    @property
    def exit_known(self) -> bool:
        return self.exitcode != 255

    def kill(self) -> None:
        self.alive = False

    def kill_group(self) -> None:  # with its follower ranks (tests/unit/test_fork_server.py)
        self.alive = False

    def join(self, timeout: float | None = None) -> None:
        pass


class Control:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)


class Harness:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, serving: threading.Event, ok: bool) -> None:
        """Starts block until `serving` is set, then succeed (ok) or fail."""
        self.events: list[tuple[str, str]] = []
        self.unlinked: list[bytes] = []
        self.spawned: list[Worker] = []
        self.starting = threading.Event()  # a restarted process waits for its peers

        self.secrets: list[DeploymentSecret | None] = []  # each start's

        def spawn(config, role: str, index: int, secret: DeploymentSecret | None, kv_store: str | None = None) -> Worker:
            w = Worker(f"{role}-{index}", Process(), Control())
            self.spawned.append(w)
            self.secrets.append(secret)
            return w

        def await_ready(w: Worker, timeout: float) -> None:
            w.address, w.metadata = f"tcp://new-{len(self.spawned)}", f"segment-{len(self.spawned)}".encode()

        def await_serving(w: Worker, timeout: float) -> None:
            self.starting.set()
            serving.wait(10)
            if not ok:
                raise RuntimeError(f"worker {w.name} did not take its peers")

        monkeypatch.setattr(supervision, "spawn", spawn)
        monkeypatch.setattr(supervision, "await_ready", await_ready)
        monkeypatch.setattr(supervision, "await_serving", await_serving)
        monkeypatch.setattr(local, "peers_messages", lambda decode, prefill: (b"to-decode", b"to-prefill"))
        for module in (supervision, local):
            monkeypatch.setattr(module, "unlink_segment", self.unlinked.append)
        self.workers = LocalWorkers(decode=[Worker("decode-0", Process(False), Control(), "tcp://a", b"old-0"),
                                            Worker("decode-1", Process(), Control(), "tcp://b", b"old-1")],
                                    secret=DeploymentSecret.new())
        self.supervisor = supervision.LocalSupervisor(
            None, self.workers, lambda name: self.events.append(("down", name)),
            lambda name, address: self.events.append(("moved", name)), interval_s=0.02, max_restarts=2,
            stays_down=lambda name, why: self.events.append(("stays down", name, why)))

    def wait(self, condition, what: str, timeout: float = 5.0) -> None:
        end = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < end, f"not within {timeout} s: {what}; events {self.events}"
            time.sleep(0.01)


@pytest.mark.timeout(30)
def test_deaths_are_reported_during_a_restart_and_failed_starts_are_retried_then_given_up(monkeypatch) -> None:
    serving = threading.Event()
    h = Harness(monkeypatch, serving, ok=False)
    h.supervisor.start()
    try:
        h.wait(h.starting.is_set, "decode-0's restart is loading")
        h.workers.decode[1].process.alive = False  # decode-1 dies meanwhile
        h.wait(lambda: ("down", "decode-1") in h.events, "decode-1 reported down while decode-0 still starts")
        assert not serving.is_set()
        serving.set()  # every start fails from now on
        h.wait(lambda: len(h.spawned) == 4 and not any(t.name.startswith("restart-") for t in threading.enumerate()),
               "two starts each, then no more")
        time.sleep(0.2)
        assert len(h.spawned) == 4 and not any(e[0] == "moved" for e in h.events)
        assert h.secrets == [h.workers.secret] * 4  # a restart joins the same deployment
        assert sorted(h.unlinked) == [b"old-0", b"old-1", b"segment-1", b"segment-2", b"segment-3", b"segment-4"]
        assert all(not w.process.alive for w in h.spawned)
        # the router is told no restart will come (its 503s said "retry later")
        h.wait(lambda: sum(e[0] == "stays down" for e in h.events) == 2, "both reported down for good")
        assert {e[1] for e in h.events if e[0] == "stays down"} == {"decode-0", "decode-1"}
        assert all("started again 2 times (local.max_restarts)" in e[2] for e in h.events if e[0] == "stays down")
    finally:
        serving.set()
        h.supervisor.stop()


@pytest.mark.timeout(30)
def test_a_restart_completes_then_a_shutdown_stops_a_worker_still_starting(monkeypatch) -> None:
    serving = threading.Event()
    h = Harness(monkeypatch, serving, ok=True)
    h.workers.decode[1].process.alive = False
    h.supervisor.start()
    h.wait(lambda: len(h.spawned) == 2 and h.starting.is_set(), "both restarts loading")
    h.supervisor.stop()  # while they are still starting
    assert all(not w.process.alive for w in h.spawned)  # not left to run unseen by the launcher
    serving.set()
    time.sleep(0.1)
    assert not any(e[0] == "moved" for e in h.events)


@pytest.mark.timeout(30)
def test_the_local_launcher_supervises_with_the_configs_max_restarts() -> None:
    from cluster.config import ClusterConfig
    from cluster.launcher import RouterHooks
    from cluster.local.launcher import LocalLauncher

    config = ClusterConfig.from_dict({"model": "m", "local": {"max_restarts": 7}})
    workers = LocalWorkers()
    LocalLauncher().supervise(config, workers, RouterHooks(lambda name: None, lambda name, address: None))
    try:
        assert workers.supervisor is not None and workers.supervisor.max_restarts == 7
    finally:
        workers.stop()


@pytest.mark.timeout(30)
def test_workers_are_ready_as_each_says_so_and_a_late_one_is_named(caplog: pytest.LogCaptureFixture) -> None:
    """start_workers' wait (local.await_all_ready): each worker's "ready" line comes when
    its own Ready does, not in the order they were started."""
    import multiprocessing

    from protocol import Ready, encode

    caplog.set_level(logging.INFO, logger="pdserve.startup")
    pipes = [multiprocessing.Pipe() for _ in range(3)]
    names = ["decode-0", "prefill-0", "prefill-1"]
    workers = [Worker(name, Process(), parent) for name, (parent, _) in zip(names, pipes)]
    pipes[1][1].send_bytes(encode(Ready(name="prefill-0", address="tcp://p0", metadata=b"")))
    threading.Timer(0.2, lambda: pipes[0][1].send_bytes(encode(Ready(name="decode-0", address="tcp://d0",
                                                                     metadata=b"m")))).start()
    with pytest.raises(RuntimeError, match=r"^worker prefill-1 did not become ready within 1.0 s \(still starting\)$"):
        local.await_all_ready(workers, 1.0)
    lines = [r.getMessage() for r in caplog.records if r.name == "pdserve.startup"]
    assert [line.split(" after ")[0] for line in lines] == ["prefill-0: ready at tcp://p0", "decode-0: ready at tcp://d0"]
    assert (workers[0].address, workers[0].metadata) == ("tcp://d0", b"m")


def sigterm_death(monkeypatch: pytest.MonkeyPatch, serving: threading.Event, grace_s: float) -> Harness:
    """decode-1 found dead of SIGTERM, decode-0 alive, the watch started."""
    import signal

    monkeypatch.setattr(supervision, "SIGTERM_GRACE_S", grace_s)
    h = Harness(monkeypatch, serving, ok=True)
    h.workers.decode[0].process.alive = True
    h.workers.decode[1].process.alive, h.workers.decode[1].process.exitcode = False, -signal.SIGTERM
    h.supervisor.start()
    return h


@pytest.mark.timeout(30)
def test_a_sigterm_death_during_shutdown_is_not_taken_for_a_crash(monkeypatch) -> None:
    """A SIGTERM to the whole process group (timeout, kill -TERM -PGID, systemd) kills
    the workers as it reaches the launcher: the watch must not report them down and
    restart them while the launcher stops. Repro: /work/shared/repro/issue19/."""
    serving = threading.Event()
    h = sigterm_death(monkeypatch, serving, grace_s=5.0)
    time.sleep(0.2)  # several watch intervals
    h.workers.decode[0].process.alive, h.workers.decode[0].process.exitcode = False, 1  # a crash meanwhile
    h.wait(lambda: ("down", "decode-0") in h.events, "a crash is handled while decode-1's grace runs")
    h.workers.stop_supervising()  # the launcher's shutdown, first of all
    serving.set()
    h.wait(lambda: not any(t.name.startswith("restart-") for t in threading.enumerate()),
           "the restart thread ended (before this test's fakes are undone)")
    assert ("down", "decode-1") not in h.events and len(h.spawned) <= 1


@pytest.mark.timeout(30)
def test_an_exit_nobody_knows_the_status_of_gets_the_sigterm_grace(monkeypatch) -> None:
    """After the fork server died, a worker's exit status is lost (255): it may be the
    group's SIGTERM of a shutdown, so it waits out the grace like a SIGTERM death."""
    serving = threading.Event()
    h = sigterm_death(monkeypatch, serving, grace_s=5.0)
    h.workers.decode[1].process.exitcode = 255
    time.sleep(0.3)  # several watch intervals
    assert ("down", "decode-1") not in h.events
    h.workers.stop_supervising()
    serving.set()
    h.wait(lambda: not any(t.name.startswith("restart-") for t in threading.enumerate()), "no restart left")
    assert ("down", "decode-1") not in h.events


@pytest.mark.timeout(60)
def test_the_launcher_stops_supervising_before_draining_its_http_requests(monkeypatch) -> None:
    """A group SIGTERM with a request in flight: the HTTP server's drain waits for it
    (its workers died of the same signal), longer than SIGTERM_GRACE_S; the supervisor
    must be stopped before that drain, not after."""
    import cluster.serve as serve_module
    from cluster.local.launcher import LocalLauncher

    order: list[str] = []

    class Supervisor:
        def stop(self, timeout: float = 10.0) -> None:
            order.append("supervisor stopped")

    class HTTP:
        url = "http://127.0.0.1:1"

        def __init__(self, *args) -> None:
            pass

        def alive(self) -> bool:
            return False

        def stop(self) -> None:
            order.append("http drained")

    workers = LocalWorkers()
    workers.supervisor = Supervisor()
    monkeypatch.setattr(serve_module, "build", lambda config: (workers, type("R", (), {"control": type("Control", (), {
        "worker_down": None, "worker_moved": None, "silent": None, "worker_stays_down": None})()})()))
    monkeypatch.setattr(serve_module, "HTTPServer", HTTP)
    monkeypatch.setattr(serve_module, "wait_for_signal", lambda alive: None)
    monkeypatch.setattr(serve_module, "check_port_free", lambda host, port: None)
    monkeypatch.setattr(LocalLauncher, "supervise", lambda self, config, w, hooks: None)
    config = type("C", (), {"model": "m", "transport": "shm", "router": type("R", (), {"host": "h", "port": 1})(),
                            "autoscale": type("A", (), {"enabled": False})()})()
    LocalLauncher().serve(config, detach=False)
    assert order == ["supervisor stopped", "http drained"]


@pytest.mark.timeout(30)
def test_a_lone_sigterm_death_is_a_crash_after_the_grace(monkeypatch) -> None:
    serving = threading.Event()
    h = sigterm_death(monkeypatch, serving, grace_s=0.2)
    try:
        h.wait(lambda: ("down", "decode-1") in h.events and h.starting.is_set(), "decode-1 down and restarting")
    finally:
        h.supervisor.stop()  # first: the restart, let go next, then ends without serving
        serving.set()
        h.wait(lambda: not any(t.name.startswith("restart-") for t in threading.enumerate()),
               "the restart thread ended (before this test's fakes are undone)")


@pytest.mark.timeout(30)
def test_a_worker_the_router_declared_dead_for_its_silence_is_killed_then_restarted(monkeypatch) -> None:
    """A stopped or wedged process that still runs (a hung prefill worker keeps decode
    workers' blocks fenced for as long as it lives): killed, then handled as a crash.
    A worker the router hears from is left alone."""
    serving = threading.Event()
    serving.set()
    h = Harness(monkeypatch, serving, ok=True)
    h.workers.decode[0].process.alive = True  # both run
    hung = {"decode-1"}
    h.supervisor.silent = lambda: set(hung)
    h.supervisor.start()
    try:
        h.wait(lambda: ("moved", "decode-1") in h.events, "decode-1 killed, reported down and restarted")
        hung.clear()
        assert h.events[:1] == [("down", "decode-1")] and len(h.spawned) == 1
        assert h.workers.decode[0].process.alive  # never silent: untouched
    finally:
        h.supervisor.stop()
