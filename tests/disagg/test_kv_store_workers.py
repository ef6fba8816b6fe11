"""The shared KV store (kv_store:) in a deployment of worker processes: the launcher
starts it before the workers, on the deployment's CURVE plane; a decode worker killed
and restarted by the supervisor loads the prefixes its earlier life put there, and a
prefill worker that never saw a prompt loads its prefix from there for a remote
prefill; the tokens are the colocated engine's. Killing the store costs only time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.config import ClusterConfig
from cluster.local.kv_store import start_store
from engine import LLM, SamplingParams
from protocol.stats import WorkerStats
from tests.disagg.test_local_supervision import Supervised, back_in_service
from tests.disagg.test_worker_processes import PARAMS, Client
from tests.fidelity.test_hf_fidelity import random_prompts
from tests.unit.test_kv_tiers import gib

pytestmark = pytest.mark.timeout(240)

PROMPTS = random_prompts([70, 66, 75, 68], seed=21)  # about 4 blocks of 16 each
OTHERS = [p + q for p, q in zip(PROMPTS, random_prompts([20, 24, 18, 22], seed=22))]  # their next turns


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> dict[str, list[int]]:
    llm = LLM(str(llama_dir), num_kv_blocks=200)
    params = SamplingParams(max_tokens=PARAMS["max_tokens"], temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS + OTHERS, params, use_tqdm=False)
    llm.core.close()
    return {f"p{i}": o.token_ids for i, o in enumerate(outs[:len(PROMPTS)])} | {
        f"o{i}": o.token_ids for i, o in enumerate(outs[len(PROMPTS):])}


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
