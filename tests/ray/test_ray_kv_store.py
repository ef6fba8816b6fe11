"""The shared KV store (kv_store:) on Ray: the launcher starts it as an actor before the
workers, on the deployment's CURVE plane, and gives each worker its address; a prefix
the decode worker computed is loaded from the store by the prefill worker, which never
saw it. Killed, the store actor is restarted by Ray at the same address, and the
workers use the new store (they tell it by its id) without being told. A worker added
at runtime is given the store too. The tokens are the colocated engine's.

One private Ray (3 CPUs: 1 prefill + 1 decode actor, and one added; the store asks for
none) and the tiny test model."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from cluster.config import ClusterConfig
from cluster.ray.elastic import RayPools
from cluster.ray.workers import RayWorkers, start_ray_workers
from engine import LLM, SamplingParams
from protocol.stats import WorkerStats
from tests.disagg.test_kv_store_workers import OTHERS, PROMPTS, one_by_one, shared_hits
from tests.disagg.test_worker_processes import PARAMS, Client
from tests.ray.conftest import assert_ray_gone, descendants
from tests.unit.test_kv_tiers import gib

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def deployment(llama_dir: Path) -> Iterator[tuple[ClusterConfig, RayWorkers]]:
    assert not ray.is_initialized(), "another test left Ray connected in this process"
    before = descendants()
    # Device pools of about 1.5 prompts: the prefill worker has only what the store gives it.
    engine = {"num_kv_blocks": 10, "kv_offload_gib": gib(2), "num_threads": 1}
    config = ClusterConfig.from_dict({
        "model": str(llama_dir), "transport": "shm", "launcher": "ray", "prefill_deadline_s": 60.0,
        "ray": {"address": "local", "num_cpus": 3, "max_restarts": 1},
        "kv_store": {"enabled": True, "capacity_gib": gib(200)},
        "prefill": {"replicas": 1, "engine": engine}, "decode": {"replicas": 1, "engine": engine}})
    workers = start_ray_workers(config)
    try:
        yield config, workers
    finally:
        workers.stop()
    assert workers.store is None
    assert_ray_gone(before)


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> dict[str, list[int]]:
    llm = LLM(str(llama_dir), num_kv_blocks=200)
    params = SamplingParams(max_tokens=PARAMS["max_tokens"], temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS[:3] + OTHERS[:2], params, use_tqdm=False)
    llm.core.close()
    return {f"p{i}": o.token_ids for i, o in enumerate(outs[:3])} | {f"o{i}": o.token_ids for i, o in enumerate(outs[3:])}


def shared_blocks(stats: WorkerStats) -> int:
    """Blocks in the worker's copy of the store's directory."""
    assert stats.kv_tiers is not None
    return sum(t.used_blocks for t in stats.kv_tiers.tiers if t.name == "shared")


def wait_until(client: Client, ok, what: str, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while not ok(client.stats()):
        assert time.monotonic() < end, what
        time.sleep(0.1)


def compute_then_load(workers: RayWorkers, reference: dict[str, list[int]], i: int) -> None:
    """Decode computes prompt i; its next turn is prefilled remotely, from the store."""
    decode = Client(workers.decode[0].address, workers.secret)
    prefill = Client(workers.prefill[0].address, workers.secret)
    try:
        hits = shared_hits(prefill.stats())
        assert one_by_one(decode, {f"p{i}": PROMPTS[i]}, remote=False) == {f"p{i}": reference[f"p{i}"]}
        # Written through to the store as they were cached; the prefill worker's copy of
        # its directory syncs every 0.2 s.
        wait_until(prefill, lambda s: shared_blocks(s) >= len(PROMPTS[i]) // 16, "the prefill worker's "
                   "directory never showed the decode worker's blocks")
        remote = decode.stats().remote
        assert one_by_one(decode, {f"o{i}": OTHERS[i]}, remote=True) == {f"o{i}": reference[f"o{i}"]}
        assert decode.stats().remote == remote + 1
        assert shared_hits(prefill.stats()) > hits, prefill.stats().kv_tiers
    finally:
        decode.close()
        prefill.close()


def test_a_prefix_the_decode_worker_computed_is_loaded_by_the_prefill_worker(deployment, reference) -> None:
    _, workers = deployment
    assert workers.store_address is not None and workers.store_address.startswith("tcp://127.0.0.1:")
    assert ray.get(workers.store.address.remote(), timeout=10) == workers.store_address
    compute_then_load(workers, reference, 0)


def test_a_killed_store_actor_comes_back_at_its_address_and_serves_the_workers(deployment, reference) -> None:
    _, workers = deployment
    store = workers.store
    pid = ray.get(store.pid.remote(), timeout=10)
    os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + 60
    while True:  # calls fail until Ray has restarted it
        try:
            if ray.get(store.pid.remote(), timeout=10) != pid:
                break
        except ray.exceptions.RayActorError:
            pass
        assert time.monotonic() < end, "Ray did not restart the store actor"
        time.sleep(0.2)
    assert ray.get(store.address.remote(), timeout=10) == workers.store_address
    prefill = Client(workers.prefill[0].address, workers.secret)
    try:  # the old store's blocks are gone from the workers' copies (it did not answer, or a new id)
        wait_until(prefill, lambda s: shared_blocks(s) == 0, "the prefill worker kept the dead store's blocks")
    finally:
        prefill.close()
    compute_then_load(workers, reference, 1)


def test_a_worker_added_at_runtime_is_given_the_store(deployment, reference) -> None:
    config, workers = deployment
    decode = Client(workers.decode[0].address, workers.secret)
    try:  # blocks in the store, whatever the tests before left there
        assert one_by_one(decode, {"p2": PROMPTS[2]}, remote=False) == {"p2": reference["p2"]}
    finally:
        decode.close()
    pools = RayPools(config, workers)
    added = pools.add_worker("prefill")
    try:
        client = Client(added.address, workers.secret)
        try:
            wait_until(client, lambda s: shared_blocks(s) >= len(PROMPTS[2]) // 16,
                       "the added worker has no copy of the store's directory")
        finally:
            client.close()
    finally:
        pools.remove_worker(added.name)
