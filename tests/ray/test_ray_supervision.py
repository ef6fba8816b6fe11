"""Supervision on Ray: worker actors are killed (SIGKILL to the actor's process), Ray
restarts them, and the supervisor wires them back in (cluster/ray/supervisor.py).

- A decode worker killed mid-stream: the streaming client still receives exactly the
  engine's greedy text (the router fails it over to the other decode worker); the
  killed worker comes back at a new address and serves requests again.
- The prefill worker killed: a long prompt still completes, prefilled locally on the
  decode worker; the prefill worker comes back and prefills again.

One private Ray (3 CPUs: 2 decode + 1 prefill actors) and the tiny test model."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from cluster.config import ClusterConfig
from cluster.ray.workers import RayWorker, RayWorkers
from cluster.serve import build
from engine import LLM, SamplingParams
from tests.disagg.test_failover import MAX_TOKENS, PROMPT, metric, served_by, stream
from tests.disagg.test_worker_processes import Client
from tests.http_server import free_port, serving
from tests.ray.conftest import descendants

LONG_PROMPT = "Paged attention keeps keys and values in fixed-size blocks of the cache. " * 6
VARIANTS = ("First, ", "Second, ", "Third, ")
RESTART_WAIT_S = 90  # a new actor process: Python, torch and the model load again


@pytest.fixture(scope="module")
def deployment(llama_dir: Path) -> Iterator[tuple[str, RayWorkers]]:
    assert not ray.is_initialized(), "another test left Ray connected in this process"
    before = descendants()
    config = ClusterConfig.from_dict({
        "model": str(llama_dir), "transport": "shm", "launcher": "ray",
        "ray": {"address": "local", "num_cpus": 3, "probe_interval_s": 0.5, "probe_timeout_s": 3.0,
                "max_restarts": 2},
        "router": {"port": free_port(), "policy": "round_robin", "health_interval_s": 0.2,
                   "worker_timeout_s": 3.0, "remote_prefill_min_tokens": 32},
        "prefill": {"replicas": 1, "engine": {"num_kv_blocks": 64, "num_threads": 1}},
        "decode": {"replicas": 2, "engine": {"num_kv_blocks": 64, "num_threads": 1}}})
    workers, router = build(config)
    assert isinstance(workers, RayWorkers) and workers.supervisor is not None
    # Workers listen on their node's address as Ray knows it: loopback here (conftest).
    assert all(w.address.startswith("tcp://127.0.0.1:") for w in workers.all)
    try:
        with serving(router, config.router.port) as base:
            yield base, workers
    finally:
        workers.stop()
    end = time.monotonic() + 15
    while descendants() - before and time.monotonic() < end:
        time.sleep(0.2)
    assert not descendants() - before, "Ray processes outlived the deployment"


@pytest.fixture(scope="module")
def expected(llama_dir: Path) -> dict[str, str]:
    """The offline engine's greedy text: the stream, and one long prompt per variant
    (each prompt is new to every decode worker, so none has it cached: a cached prompt
    is rightly prefilled locally)."""
    llm = LLM(str(llama_dir), num_kv_blocks=64)
    stream_params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    texts = {"stream": llm.generate([PROMPT], stream_params, use_tqdm=False)[0].text}
    for variant in VARIANTS:
        texts[variant] = llm.generate([variant + LONG_PROMPT], params, use_tqdm=False)[0].text
    return texts


def kill(w: RayWorker) -> None:
    os.kill(ray.get(w.actor.pid.remote(), timeout=10), signal.SIGKILL)


def wait_restarted(workers: RayWorkers, count: int, w: RayWorker, old_address: str) -> None:
    end = time.monotonic() + RESTART_WAIT_S
    while not (workers.supervisor.restarts >= count and w.alive):
        assert time.monotonic() < end, f"{w.name} was not restarted within {RESTART_WAIT_S} s"
        time.sleep(0.2)
    assert w.address != old_address and w.address.startswith("tcp://127.0.0.1:")  # a new process


def long_completion(base: str, variant: str) -> str:
    import httpx2 as httpx

    r = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "prompt": variant + LONG_PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def router_sees_prefill_live(base: str) -> bool:
    import httpx2 as httpx

    return all(w["live"] for w in httpx.get(f"{base}/status", timeout=10).json()["prefill_workers"])


def decode_stats(workers: RayWorkers) -> dict[str, int]:
    """remote / local / fallbacks summed over the live decode workers."""
    total = {"remote": 0, "local": 0, "fallbacks": 0}
    for w in workers.decode:
        client = Client(w.address, workers.secret)
        try:
            stats = client.stats()
        finally:
            client.close()
        for key in total:
            total[key] += getattr(stats, key)
    return total


@pytest.mark.timeout(240)
def test_a_decode_actor_killed_mid_stream_fails_over_and_comes_back(deployment, expected) -> None:
    base, workers = deployment
    before = metric(base, "pdserve_decode_failovers_total")
    killed: list[RayWorker] = []
    addresses = {w.name: w.address for w in workers.decode}

    def on_first_chunk(name: str) -> None:
        w = next(w for w in workers.decode if w.name == name)
        kill(w)
        killed.append(w)

    text, chunks = stream(base, on_first_chunk)
    assert killed and text == expected["stream"] and chunks > 1
    assert metric(base, "pdserve_decode_failovers_total") == before + 1
    w = killed[0]
    wait_restarted(workers, 1, w, addresses[w.name])
    end = time.monotonic() + 20
    while metric(base, "pdserve_decode_workers_live") != 2:
        assert time.monotonic() < end, "the router did not re-admit the restarted worker"
        time.sleep(0.2)
    # round_robin: within two requests the restarted worker serves one.
    assert w.name in {served_by(base), served_by(base)}
    again, _ = stream(base, lambda name: None)
    assert again == expected["stream"]


@pytest.mark.timeout(240)
def test_a_killed_prefill_actor_falls_back_to_local_prefill_and_comes_back(deployment, expected) -> None:
    base, workers = deployment
    prefill = workers.prefill[0]
    before = decode_stats(workers)
    first, second, third = VARIANTS
    assert long_completion(base, first) == expected[first]
    start = decode_stats(workers)
    assert start["remote"] == before["remote"] + 1  # the prefill actor computed that prompt's KV
    restarts, old_address = workers.supervisor.restarts, prefill.address
    kill(prefill)
    t0 = time.monotonic()
    assert long_completion(base, second) == expected[second]
    assert time.monotonic() - t0 < 25, "the fallback waited for the prefill deadline (30 s)"
    after = decode_stats(workers)
    # Prefilled on the decode worker: as a fallback (sent before the death was known) or
    # at once (the router or the decode worker already knew).
    assert after["local"] + after["fallbacks"] == start["local"] + start["fallbacks"] + 1
    wait_restarted(workers, restarts + 1, prefill, old_address)
    end = time.monotonic() + 20
    while not router_sees_prefill_live(base):  # its next ping reply re-admits it
        assert time.monotonic() < end, "the router did not re-admit the restarted prefill worker"
        time.sleep(0.2)
    assert long_completion(base, third) == expected[third]
    assert decode_stats(workers)["remote"] == after["remote"] + 1  # prefilled remotely again
