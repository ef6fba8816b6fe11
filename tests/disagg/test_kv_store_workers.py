"""The shared KV store (kv_store:) in a deployment of worker processes: the launcher
starts it before the workers, on the deployment's CURVE plane; a decode worker killed
and restarted by the supervisor loads the prefixes its earlier life put there, and a
prefill worker that never saw a prompt loads its prefix from there for a remote
prefill; the tokens are the colocated engine's. Killing the store costs only time, and
the supervisor starts it again at the same address: the workers' blocks reach the new
store and later requests load from it."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import cluster.local.kv_store
from cluster.config import ClusterConfig
from cluster.local.kv_store import StoreProcess, start_store
from cluster.local.supervisor import STORE, LocalSupervisor
from cluster.local.workers import LocalWorkers
from engine import LLM, SamplingParams
from protocol.stats import WorkerStats
from tests.disagg.test_local_supervision import Lines, Supervised, back_in_service
from tests.disagg.test_worker_processes import PARAMS, Client
from tests.fidelity.test_hf_fidelity import random_prompts
from tests.unit.test_kv_store import holding
from tests.unit.test_kv_tiers import gib

pytestmark = pytest.mark.timeout(240)

PROMPTS = random_prompts([70, 66, 75, 68], seed=21)  # about 4 blocks of 16 each
OTHERS = [p + q for p, q in zip(PROMPTS, random_prompts([20, 24, 18, 22], seed=22))]  # their next turns
[FRESH] = random_prompts([69], seed=23)  # seen by no worker before the store's restart
FRESH_NEXT = FRESH + random_prompts([21], seed=24)[0]


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> dict[str, list[int]]:
    llm = LLM(str(llama_dir), num_kv_blocks=200)
    params = SamplingParams(max_tokens=PARAMS["max_tokens"], temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS + OTHERS + [FRESH, FRESH_NEXT], params, use_tqdm=False)
    llm.core.close()
    return {f"p{i}": o.token_ids for i, o in enumerate(outs[:len(PROMPTS)])} | {
        f"o{i}": o.token_ids for i, o in enumerate(outs[len(PROMPTS):-2])} | {
        "fresh": outs[-2].token_ids, "fresh_next": outs[-1].token_ids}


@pytest.fixture(scope="module")
def supervised(llama_dir: Path) -> Iterator[Supervised]:
    # Device pools of about 1.5 prompts and host tiers of 2 blocks: almost everything
    # a worker evicts is found again only in the store.
    engine = {"num_kv_blocks": 10, "kv_offload_gib": gib(2)}
    s = Supervised(ClusterConfig.from_dict({
        "model": str(llama_dir), "transport": "shm", "prefill_deadline_s": 60.0,
        "kv_store": {"enabled": True, "capacity_gib": gib(200)},
        "prefill": {"replicas": 1, "engine": engine}, "decode": {"replicas": 1, "engine": engine}}))
    yield s
    s.supervisor.stop()
    s.workers.stop()
    s.startup.close()


def shared_hits(stats: WorkerStats) -> int:
    assert stats.kv_tiers is not None
    return sum(t.hits for t in stats.kv_tiers.tiers if t.name == "shared")


def wait_for_directory(client: Client, timeout: float = 10.0) -> None:
    """Until the worker's copy of the store's directory has blocks (it syncs every 0.2 s)."""
    end = time.monotonic() + timeout
    while True:
        stats = client.stats()
        assert stats.kv_tiers is not None
        if any(t.name == "shared" and t.used_blocks for t in stats.kv_tiers.tiers):
            return
        assert time.monotonic() < end, stats.kv_tiers
        time.sleep(0.1)


def shared_blocks(client: Client) -> int:
    """How many blocks the worker's copy of the store's directory holds."""
    stats = client.stats()
    assert stats.kv_tiers is not None
    return sum(t.used_blocks for t in stats.kv_tiers.tiers if t.name == "shared")


def store_serving(supervised: Supervised, timeout: float = 10.0) -> StoreProcess:
    """The store once it runs and any restart of it is done (an earlier test may have
    killed it)."""
    end = time.monotonic() + timeout
    while True:
        store, restarts = supervised.workers.store, supervised.supervisor.restarts[STORE]
        assert store is not None
        back = any(line.startswith(f"{STORE}: back in service at {store.address}, ") and
                   line.endswith(f" after restart {restarts} of 3") for line in supervised.startup.lines)
        if store.process.is_alive() and (restarts == 0 or back):
            return store
        assert time.monotonic() < end, (restarts, supervised.startup.lines)
        time.sleep(0.05)


def one_by_one(client: Client, prompts: dict[str, list[int]], remote: bool) -> dict[str, list[int]]:
    out = {}
    for rid, prompt in prompts.items():
        result = client.generate({rid: prompt}, remote=remote)[rid]
        assert result["finished"] and not result["error"], result
        out[rid] = result["tokens"]
    return out


def test_a_restarted_decode_worker_and_a_prefill_worker_load_from_the_store(supervised: Supervised,
                                                                             reference) -> None:
    assert supervised.workers.store is not None and supervised.workers.store.process.is_alive()
    decode = Client(supervised.workers.decode[0].address, supervised.workers.secret)
    try:
        got = one_by_one(decode, {f"p{i}": p for i, p in enumerate(PROMPTS)}, remote=False)
        assert got == {k: v for k, v in reference.items() if k.startswith("p")}
        for _ in range(2):  # evicts the last prompt too
            one_by_one(decode, {"flush": [7] * 150}, remote=False)
    finally:
        decode.close()
    old = supervised.workers.decode[0]
    old.process.kill()
    _, _, address = supervised.wait_for(("moved", "decode-0"), 120)
    back_in_service(supervised, "decode-0", address)
    decode = Client(address, supervised.workers.secret)
    try:
        wait_for_directory(decode)
        # The new decode worker's tiers are empty: each next turn's prefix comes from the store.
        got = one_by_one(decode, {f"o{i}": p for i, p in enumerate(OTHERS[:2])}, remote=False)
        assert got == {f"o{i}": reference[f"o{i}"] for i in range(2)}
        assert shared_hits(decode.stats()) > 0, decode.stats().kv_tiers
        # Prefilled remotely: the prefill worker never saw these prompts; the store has them.
        got = one_by_one(decode, {f"o{i}": p for i, p in enumerate(OTHERS) if i >= 2}, remote=True)
        assert got == {f"o{i}": reference[f"o{i}"] for i in range(2, len(OTHERS))}
        assert decode.stats().remote >= 2
    finally:
        decode.close()
    prefill = Client(supervised.workers.prefill[0].address, supervised.workers.secret)
    try:
        assert shared_hits(prefill.stats()) > 0
    finally:
        prefill.close()


def test_a_deployment_whose_store_died_serves_on(supervised: Supervised, reference) -> None:
    assert supervised.workers.store is not None
    supervised.workers.store.process.kill()
    supervised.workers.store.process.join(10)
    decode = Client(supervised.workers.decode[0].address, supervised.workers.secret)
    try:
        got = one_by_one(decode, {f"p{i}": p for i, p in enumerate(PROMPTS)}, remote=False)
        assert got == {k: v for k, v in reference.items() if k.startswith("p")}
        got = one_by_one(decode, {f"o{i}": p for i, p in enumerate(OTHERS)}, remote=True)
        assert got == {k: v for k, v in reference.items() if k.startswith("o")}
    finally:
        decode.close()


def test_a_store_that_fails_to_start_is_reported_at_once(llama_dir: Path) -> None:
    config = ClusterConfig.from_dict({"model": str(llama_dir), "kv_store": {"enabled": True},
                                      "decode": {"engine": {"kv_offload_gib": gib(2)}}})
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited as it started"):
        start_store(config, None, host="256.0.0.1")  # no such address: its bind fails
    assert time.monotonic() - start < 20  # its exit, not START_TIMEOUT_S


@pytest.mark.timeout(90)
def test_a_killed_store_is_restarted_at_its_address_and_serves_the_workers_again(supervised: Supervised,
                                                                                 reference) -> None:
    old = store_serving(supervised)
    restarts = supervised.supervisor.restarts[STORE]
    os.kill(old.process.pid, signal.SIGKILL)
    start = time.monotonic()
    back_in_service(supervised, STORE, old.address, timeout=10, restart=restarts + 1)
    assert time.monotonic() - start < 5  # a sweep (0.2 s here) and a fork, not a model load
    new = supervised.workers.store
    assert new is not None and new is not old and new.address == old.address and new.process.is_alive()
    decode = Client(supervised.workers.decode[0].address, supervised.workers.secret)
    try:
        # The new store is empty: the worker's copy of the old one's directory is dropped.
        end = time.monotonic() + 10
        while shared_blocks(decode) > 0:
            assert time.monotonic() < end, "the worker's directory copy is still the killed store's"
            time.sleep(0.1)
        hits = shared_hits(decode.stats())
        assert one_by_one(decode, {"fresh": FRESH}, remote=False) == {"fresh": reference["fresh"]}
        for _ in range(2):  # out of the worker's own tiers: only the new store has it then
            one_by_one(decode, {"flush": [7] * 150}, remote=False)
        wait_for_directory(decode)
        assert one_by_one(decode, {"fresh_next": FRESH_NEXT}, remote=False) == {"fresh_next": reference["fresh_next"]}
        assert shared_hits(decode.stats()) > hits, decode.stats().kv_tiers
    finally:
        decode.close()


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, what
        time.sleep(0.02)


@contextmanager
def supervised_store(llama_dir: Path, store: StoreProcess, max_restarts: int) -> Iterator[LocalWorkers]:
    """A supervisor of a deployment that is only `store` (no worker: nothing to load), and
    its stop as the launcher's (LocalWorkers.stop: the supervisor first)."""
    workers = LocalWorkers(secret=None, store=store)  # the store's: started without one
    try:
        workers.supervisor = LocalSupervisor(store_config(llama_dir), workers, lambda n: None, lambda n, a: None, interval_s=0.2,
                                             max_restarts=max_restarts)
        workers.supervisor.start()
        yield workers
    finally:
        workers.stop()


def store_config(llama_dir: Path) -> ClusterConfig:
    return ClusterConfig.from_dict({"model": str(llama_dir), "kv_store": {"enabled": True},
                                    "decode": {"engine": {"kv_offload_gib": gib(2)}}})


@pytest.mark.timeout(60)
def test_a_store_start_that_fails_is_tried_again_on_a_later_sweep_up_to_max_restarts(
        llama_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster.local.kv_store, "BIND_TIMEOUT_S", 1.0)
    caplog.set_level(logging.WARNING, logger="cluster.local.supervisor")
    lines = Lines()
    first = start_store(store_config(llama_dir), None)
    first.process.kill()
    first.process.join(10)
    held = holding(first.host, first.port)  # before the supervisor's first sweep: its first start fails
    try:
        with supervised_store(llama_dir, first, max_restarts=2) as workers:
            try:
                wait_until(lambda: "did not restart at" in caplog.text, "no failed start logged")
            finally:
                held.close()  # the next sweep's start binds it (it tries for BIND_TIMEOUT_S)
            wait_until(lambda: any(line.startswith(f"{STORE}: back in service at {first.address}, ") and
                                   line.endswith(" after restart 2 of 2") for line in lines.lines), str(lines.lines))
            second = workers.store
            assert second is not None and second is not first and second.process.is_alive()
            second.process.kill()
            wait_until(lambda: "the KV store stays down: started 2 times" in caplog.text, caplog.text)
            assert workers.store is second and workers.supervisor is not None
            assert workers.supervisor.restarts[STORE] == 2
    finally:
        held.close()
        lines.close()
    assert "exited with -9" in caplog.text


@pytest.mark.timeout(60)
def test_a_store_that_dies_of_sigterm_as_the_deployment_stops_is_not_restarted(llama_dir: Path) -> None:
    """A SIGTERM to the process group kills the store with the workers: the launcher's
    shutdown (which stops the supervisor first) comes within SIGTERM_GRACE_S."""
    lines = Lines()
    store = start_store(store_config(llama_dir), None)
    try:
        with supervised_store(llama_dir, store, max_restarts=3) as workers:
            os.kill(store.process.pid, signal.SIGTERM)
            store.process.join(10)
            time.sleep(0.5)  # sweeps see it dead, within the grace
        assert workers.store is store and not any(line.startswith(STORE) for line in lines.lines)
    finally:
        lines.close()
