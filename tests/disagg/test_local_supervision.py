"""The local launcher's supervisor (cluster/local/supervisor.py): a worker process that
dies is reported at once, its peers stop waiting for it, and it is started again and
wired back in, for either pool."""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.config import ClusterConfig
from cluster.local.supervisor import LocalSupervisor
from cluster.local.workers import LocalWorkers, start_workers
from engine import LLM, SamplingParams
from protocol import Generate
from tests.disagg.test_worker_processes import PARAMS, Client
from tests.fidelity.test_hf_fidelity import random_prompts

PROMPTS = random_prompts([40, 70], seed=12)


class Lines(logging.Handler):
    """What `pdserve serve` would print of the workers' starts (cluster/console.py)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.logger = logging.getLogger("pdserve.startup")
        self.level_before = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def close(self) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)
        super().close()


class Supervised:
    def __init__(self, config: ClusterConfig) -> None:
        self.events: list[tuple] = []
        self.startup = Lines()
        self.workers: LocalWorkers = start_workers(config)
        self.supervisor = LocalSupervisor(config, self.workers, lambda n: self.events.append(("down", n)),
                                          lambda n, a: self.events.append(("moved", n, a)), interval_s=0.2)
        self.supervisor.start()

    def wait_for(self, event: tuple, timeout: float, after: int = 0) -> tuple:
        """The latest event starting with `event`, among those from index `after` on."""
        end = time.monotonic() + timeout
        while True:
            found = [e for e in self.events[after:] if e[:len(event)] == event]
            if found:
                return found[-1]
            assert time.monotonic() < end, f"no {event} within {timeout} s: {self.events}"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def supervised(llama_dir: Path) -> Iterator[Supervised]:
    # A long KV deadline: a decode worker that waited for it would show.
    s = Supervised(ClusterConfig.from_dict({
        "model": str(llama_dir), "transport": "shm", "prefill_deadline_s": 60.0,
        "prefill": {"replicas": 1, "engine": {"num_kv_blocks": 80}},
        "decode": {"replicas": 1, "engine": {"num_kv_blocks": 80}}}))
    yield s
    s.supervisor.stop()
    s.workers.stop()
    s.startup.close()


def back_in_service(supervised: Supervised, name: str, address: str, timeout: float = 5.0, restart: int = 1) -> str:
    """The line saying that restarted worker `name` serves again at `address`."""
    pattern = re.compile(rf"^{name}: back in service at {re.escape(address)}, [0-9.]+ s after restart {restart} of 3$")
    end = time.monotonic() + timeout
    while not any(pattern.match(line) for line in supervised.startup.lines):
        assert time.monotonic() < end, supervised.startup.lines
        time.sleep(0.05)
    return address


def test_the_start_says_each_worker_loading_then_ready(supervised: Supervised, llama_dir: Path) -> None:
    lines = supervised.startup.lines
    for w in supervised.workers.all:
        role = w.name.split("-")[0]
        starting = f"{w.name}: starting ({role} worker): model {llama_dir}, device cpu, tensor parallel size 1"
        ready = re.compile(rf"^{w.name}: ready at {re.escape(w.address)} after [0-9.]+ s$")
        assert starting in lines, lines
        index = lines.index(starting)
        assert any(ready.match(line) for line in lines[index + 1:]), lines


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> list[list[int]]:
    llm = LLM(str(llama_dir), num_kv_blocks=80)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(**PARAMS), use_tqdm=False)]


@pytest.mark.timeout(240)
def test_a_killed_prefill_worker_is_routed_around_at_once_then_restarted(supervised: Supervised,
                                                                          reference) -> None:
    client = Client(supervised.workers.decode[0].address, supervised.workers.secret)
    try:
        supervised.workers.prefill[0].process.kill()
        start = time.monotonic()
        results = client.generate({"k0": PROMPTS[0]}, remote=True)  # prefilled locally
        assert results["k0"]["tokens"] == reference[0]
        assert time.monotonic() - start < 30, "waited for the KV deadline"
        supervised.wait_for(("down", "prefill-0"), 5)
        _, _, address = supervised.wait_for(("moved", "prefill-0"), 120)
        back_in_service(supervised, "prefill-0", address)
        remote = client.stats().remote
        results = client.generate({"r0": PROMPTS[1]}, remote=True)
        assert results["r0"]["tokens"] == reference[1]
        stats = client.stats()
        assert stats.remote == remote + 1 and stats.free_blocks == stats.num_blocks
    finally:
        client.close()


@pytest.mark.timeout(240)
def test_a_killed_decode_worker_is_restarted_and_its_prefill_peer_writes_to_the_new_one(
        supervised: Supervised, reference) -> None:
    old = supervised.workers.decode[0]
    old.process.kill()
    supervised.wait_for(("down", "decode-0"), 5)
    _, _, address = supervised.wait_for(("moved", "decode-0"), 120)
    assert address != old.address and supervised.workers.decode[0].address == address
    back_in_service(supervised, "decode-0", address)
    client = Client(address, supervised.workers.secret)
    try:
        results = client.generate({"n0": PROMPTS[0], "n1": PROMPTS[1]}, remote=True)
        assert [results["n0"]["tokens"], results["n1"]["tokens"]] == reference
        stats = client.stats()
        assert stats.remote == 2 and stats.fallbacks == 0
    finally:
        client.close()


@pytest.mark.timeout(240)
def test_a_stopped_prefill_worker_the_router_declares_dead_is_killed_and_its_fence_lifts(
        supervised: Supervised, reference) -> None:
    """SIGSTOP the prefill worker while it holds a decode worker's reservation: the
    decode worker waits (the KV deadline is 60 s here) with those blocks reserved. Once
    the router declares the silent worker dead (simulated here: RouterControl.silent), the
    supervisor kills it; the decode worker hears it is gone, prefills the prompt itself,
    and sees from the pid and start time that nothing can land any more (and its
    successor confirms): the fence lifts, no block stays held, and the restarted worker
    prefills again."""
    stopped = supervised.workers.prefill[0]
    client = Client(supervised.workers.decode[0].address, supervised.workers.secret)
    try:
        remote = client.stats().remote
        os.kill(stopped.process.pid, signal.SIGSTOP)
        client.send(Generate(request_id="s0", prompt=PROMPTS[1], params=PARAMS, remote=True, priority=0))
        end = time.monotonic() + 10
        while client.stats().waiting_for_kv != 1:
            assert time.monotonic() < end, "the prompt never went to the stopped prefill worker"
            time.sleep(0.05)
        assert client.stats().remote == remote + 1
        seen = len(supervised.events)
        supervised.supervisor.silent = lambda: {stopped.name}
        supervised.wait_for(("down", stopped.name), 10, after=seen)
        supervised.supervisor.silent = set
        tokens, end = [], time.monotonic() + 60
        while True:
            msg = client.recv(max(0.1, end - time.monotonic()))
            assert msg.kind == "tokens", msg
            tokens += msg.tokens
            if msg.finished:
                break
        assert tokens == reference[1]
        # Its successor, once it said hello, is waited on too (it might have been sent
        # the prompt): it confirms once it serves.
        _, _, address = supervised.wait_for(("moved", stopped.name), 120, after=seen)
        back_in_service(supervised, stopped.name, address, restart=supervised.supervisor.restarts[stopped.name])
        end = time.monotonic() + 30
        while (stats := client.stats()).quarantined_blocks or stats.free_blocks != stats.num_blocks:
            assert time.monotonic() < end, f"blocks stay held: {stats}"
            time.sleep(0.1)
        results = client.generate({"s1": PROMPTS[0]}, remote=True)
        assert results["s1"]["tokens"] == reference[0] and client.stats().remote == remote + 2
    finally:
        if stopped.process.is_alive():
            os.kill(stopped.process.pid, signal.SIGCONT)
        client.close()


@pytest.mark.timeout(120)
def test_the_fork_server_dying_alone_downs_no_worker_and_a_stop_still_ends_them(supervised: Supervised,
                                                                               reference) -> None:
    """The workers are the fork server's children: when it is killed alone, they run on
    and serve; multiprocessing alone would take them all for exited (255) and could
    no longer kill them. Last in this module: it stops the deployment."""
    workers = supervised.workers.all
    server = {parent(w.process.pid) for w in workers}
    assert len(server) == 1 and os.getpid() not in server
    seen = len(supervised.events)
    os.kill(server.pop(), signal.SIGKILL)
    time.sleep(5 * supervised.supervisor.interval_s)  # several sweeps
    assert supervised.events[seen:] == [] and all(w.process.is_alive() for w in workers)
    client = Client(supervised.workers.decode[0].address, supervised.workers.secret)
    try:
        assert client.generate({"f0": PROMPTS[0]}, remote=True)["f0"]["tokens"] == reference[0]
    finally:
        client.close()
    pids = [w.process.pid for w in workers]
    supervised.workers.stop()
    assert supervised.events[seen:] == []
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}") and state(pid) != "Z"]


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
