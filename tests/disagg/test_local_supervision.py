"""The local launcher's supervisor (cluster/local/supervisor.py): a worker process that
dies is reported at once, its peers stop waiting for it, and it is started again and
wired back in, for either pool."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.config import ClusterConfig
from cluster.local.supervisor import LocalSupervisor
from cluster.local.workers import LocalWorkers, start_workers
from engine import LLM, SamplingParams
from tests.disagg.test_worker_processes import PARAMS, Client
from tests.fidelity.test_hf_fidelity import random_prompts

PROMPTS = random_prompts([40, 70], seed=12)


class Supervised:
    def __init__(self, config: ClusterConfig) -> None:
        self.events: list[tuple] = []
        self.workers: LocalWorkers = start_workers(config)
        self.supervisor = LocalSupervisor(config, self.workers, lambda n: self.events.append(("down", n)),
                                          lambda n, a: self.events.append(("moved", n, a)), interval_s=0.2)
        self.supervisor.start()

    def wait_for(self, event: tuple, timeout: float) -> tuple:
        end = time.monotonic() + timeout
        while True:
            found = [e for e in self.events if e[:len(event)] == event]
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
        supervised.wait_for(("moved", "prefill-0"), 120)
        remote = client.stats()["remote"]
        results = client.generate({"r0": PROMPTS[1]}, remote=True)
        assert results["r0"]["tokens"] == reference[1]
        stats = client.stats()
        assert stats["remote"] == remote + 1 and stats["free_blocks"] == stats["num_blocks"]
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
    client = Client(address, supervised.workers.secret)
    try:
        results = client.generate({"n0": PROMPTS[0], "n1": PROMPTS[1]}, remote=True)
        assert [results["n0"]["tokens"], results["n1"]["tokens"]] == reference
        stats = client.stats()
        assert stats["remote"] == 2 and stats["fallbacks"] == 0
    finally:
        client.close()
