"""One prefill and one decode worker as processes, driven over ZMQ like the router will:
greedy tokens equal to the colocated engine's, bad requests refused by name, and a
killed prefill worker's requests completed by local prefill."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from cluster.config import ClusterConfig
from cluster.local.workers import LocalWorkers, start_workers
from engine import LLM, SamplingParams
from protocol import WORKER_MESSAGES, Generate, Message, Stats, WorkerStats, encode
from security import DeploymentSecret, connect_securely
from tests.fidelity.test_hf_fidelity import random_prompts

decode = WORKER_MESSAGES.decode

PARAMS = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPTS = random_prompts([3, 20, 45, 70, 33, 90], seed=11)


class Client:
    """A DEALER to one worker, as the router holds (with the deployment's secret)."""

    def __init__(self, address: str, secret: DeploymentSecret | None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, b"test-router")
        if secret is not None:
            connect_securely(self.sock, secret)
        self.sock.connect(address)

    def send(self, message: Message) -> None:
        self.sock.send(encode(message))

    def recv(self, timeout: float) -> dict:
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no message within {timeout} s")
        return decode(self.sock.recv())

    def generate(self, prompts: dict[str, list[int]], remote: bool, params=PARAMS,
                 timeout: float = 60.0) -> dict[str, dict]:
        for rid, prompt in prompts.items():
            self.send(Generate(request_id=rid, prompt=prompt, params=params, remote=remote, priority=0))
        results = {rid: {"tokens": [], "finished": False, "reason": "", "error": ""} for rid in prompts}
        end = time.monotonic() + timeout
        while not all(r["finished"] or r["error"] for r in results.values()):
            msg = self.recv(max(0.1, end - time.monotonic()))
            r = results[msg.request_id]
            if msg.kind == "rejected":
                r["error"] = msg.error
            else:
                r["tokens"] += msg.tokens
                r["finished"], r["reason"] = msg.finished, msg.reason
        return results

    def stats(self) -> WorkerStats:
        self.send(Stats(seq=0))
        return self.recv(10).stats

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def workers(llama_dir: Path) -> Iterator[LocalWorkers]:
    config = ClusterConfig.from_dict({
        "model": str(llama_dir), "transport": "shm", "prefill_deadline_s": 5.0,
        "prefill": {"replicas": 1, "engine": {"num_kv_blocks": 80, "max_num_batched_tokens": 24}},
        "decode": {"replicas": 1, "engine": {"num_kv_blocks": 80}}})
    started = start_workers(config)
    yield started
    started.stop()


@pytest.fixture
def client(workers: LocalWorkers) -> Iterator[Client]:
    c = Client(workers.decode[0].address, workers.secret)
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> list[list[int]]:
    llm = LLM(str(llama_dir), num_kv_blocks=80)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(**PARAMS), use_tqdm=False)]


@pytest.mark.timeout(180)
def test_disaggregated_tokens_match_colocated(client: Client, reference) -> None:
    results = client.generate({f"a{i}": p for i, p in enumerate(PROMPTS)}, remote=True)
    assert [results[f"a{i}"]["tokens"] for i in range(len(PROMPTS))] == reference
    assert all(r["reason"] == "length" for r in results.values())
    stats = client.stats()
    assert stats.remote >= len(PROMPTS) - 1 and stats.fallbacks == 0
    assert stats.free_blocks == stats.num_blocks


@pytest.mark.timeout(60)
def test_stats_replies_carry_the_prefix_cache_events_for_the_router(client: Client) -> None:
    from engine.kv_cache.block_hash import hash_full_blocks

    client.send(Stats(seq=1))
    client.recv(10)  # events so far: not this test's
    prompt = list(range(300, 340))  # 2 full blocks of 16 (the last token is never cached)
    client.generate({"events": prompt}, remote=False)
    client.send(Stats(seq=2))
    reply = client.recv(10)
    assert reply.kv_reset is False
    cached = [h for h, tier, stored in reply.kv_events if stored and tier == 0]
    assert hash_full_blocks(prompt, 16) == cached[:2]  # the prompt's blocks, in order
    client.send(Stats(seq=3))
    assert client.recv(10).kv_events == []  # each event is reported once


@pytest.mark.timeout(60)
def test_bad_request_is_refused_by_name_and_serving_goes_on(client: Client, reference) -> None:
    results = client.generate({"bad": PROMPTS[0]}, remote=False, params={"max_tokens": 0})
    assert "max_tokens must be an integer >= 1" in results["bad"]["error"]
    results = client.generate({"bad3": PROMPTS[0]}, remote=False, params={"temprature": 0.5})
    assert "unknown field `temprature`" in results["bad3"]["error"]
    # The router owns the vocabulary: a prompt outside it reaching a worker is its bug.
    results = client.generate({"bad2": [10**6]}, remote=False)
    assert results["bad2"]["error"].startswith("internal error (a router bug): prompt token ids must be integers "
                                               "in [0, 384)")
    assert client.generate({"ok": PROMPTS[1]}, remote=False)["ok"]["tokens"] == reference[1]


@pytest.mark.timeout(180)
def test_killed_prefill_worker_falls_back_to_local_prefill(workers: LocalWorkers, client: Client,
                                                           reference) -> None:
    workers.prefill[0].process.kill()
    workers.prefill[0].process.join(10)
    start = time.monotonic()
    results = client.generate({f"k{i}": p for i, p in enumerate(PROMPTS[:3])}, remote=True)
    assert [results[f"k{i}"]["tokens"] for i in range(3)] == reference[:3]
    assert time.monotonic() - start < 30  # the 5 s deadline, then local prefill
    # No supervisor tells the decode worker: it sees the prefill worker's process gone
    # itself (pid and start time) and lifts the fence within a resend interval.
    end = time.monotonic() + 10
    while (stats := client.stats()).quarantined_blocks:
        assert time.monotonic() < end, f"{stats.quarantined_blocks} blocks stay fenced after the sender died"
        time.sleep(0.1)
    assert stats.fallbacks >= 2 and stats.free_blocks == stats.num_blocks
