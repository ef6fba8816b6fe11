"""Tensor-parallel workers served over real HTTP by the local launcher: a prefill
worker at TP 1 pushes KV into decode workers at TP 2 (shm). Completions equal the
offline engine's; a TP group shows as one worker with its ranks; a rank killed
mid-stream takes its worker down loudly, its request fails over to the other decode
worker token for token, and the supervisor restarts the whole group."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from cluster.config import ClusterConfig
from cluster.launcher import RouterHooks
from cluster.local.launcher import LocalLauncher
from cluster.local.workers import LocalWorkers
from cluster.serve import build
from engine import LLM, SamplingParams
from tests.disagg.test_failover import MAX_TOKENS, PROMPT, metric, stream
from tests.http_server import free_port, serving


def status(base: str) -> dict:
    return httpx.get(f"{base}/status", timeout=10).json()


def decode_ranks(base: str) -> dict[str, list[int]]:
    return {w["name"]: (w["stats"] or {}).get("ranks", []) for w in status(base)["decode_workers"]}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[tuple[str, LocalWorkers]]:
    config = ClusterConfig.from_dict({
        "model": str(llama_dir), "transport": "shm",
        # A dead group is reported by the supervisor at once; a long silence limit keeps
        # a survivor busy with the failed-over request (and the restart loading beside
        # it) from being declared dead on a loaded machine.
        "router": {"port": free_port(), "policy": "round_robin", "health_interval_s": 0.2,
                   "worker_timeout_s": 15.0, "remote_prefill_min_tokens": 4},
        "prefill": {"replicas": 1, "engine": {"num_kv_blocks": 64, "num_threads": 1}},
        "decode": {"replicas": 2, "engine": {"num_kv_blocks": 64, "num_threads": 1, "tensor_parallel_size": 2,
                                             "distributed_timeout_s": 10.0}}})
    workers, router = build(config)
    try:
        with serving(router, config.router.port) as base:
            # As `pdserve serve` does: an exited worker is reported, routed around, restarted.
            LocalLauncher().supervise(config, workers, RouterHooks.of(router.control))
            yield base, workers
    finally:
        workers.stop()


@pytest.fixture(scope="module")
def expected(llama_dir: Path) -> str:
    llm = LLM(str(llama_dir), num_kv_blocks=64)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].text


@pytest.mark.timeout(180)
def test_tp_workers_serve_the_engines_tokens_with_remote_prefill(server, expected: str) -> None:
    base, _ = server
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    for _ in range(2):  # one per decode worker (round robin)
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
    decode = status(base)["decode_workers"]
    assert sum(w["stats"]["remote"] for w in decode) == 2  # both prompts prefilled by the prefill worker
    for w in decode:  # one worker each, with two ranks: its own process and a follower
        ranks = w["stats"]["ranks"]
        assert len(ranks) == 2 and all(alive(pid) for pid in ranks)


@pytest.mark.timeout(240)
def test_a_rank_killed_mid_stream_fails_over_and_the_group_restarts(server, expected: str) -> None:
    base, workers = server
    before_ranks = decode_ranks(base)
    before = metric(base, "pdserve_decode_failovers_total")
    killed: list[int] = []

    def kill_a_follower(worker: str) -> None:
        follower = before_ranks[worker][1]
        os.kill(follower, signal.SIGKILL)
        killed.append(follower)

    text, chunks = stream(base, kill_a_follower)
    assert killed and chunks > 1 and text == expected  # the other worker went on, token for token
    assert metric(base, "pdserve_decode_failovers_total") == before + 1
    # The group is restarted as a whole: new ranks, and none of the old group left.
    end = time.monotonic() + 120
    while True:
        now = decode_ranks(base)
        if metric(base, "pdserve_decode_workers_live") == 2 and all(len(r) == 2 for r in now.values()) \
                and now != before_ranks:
            break
        assert time.monotonic() < end, f"the TP group did not come back: {now}"
        time.sleep(0.5)
    hit = next(name for name, ranks in before_ranks.items() if killed[0] in ranks)
    assert set(now[hit]).isdisjoint(before_ranks[hit])
    assert not any(alive(pid) for pid in before_ranks[hit])
    again, _ = stream(base, lambda worker: None)
    assert again == expected
