"""Decode-worker failover at the router, over real HTTP: two decode worker processes
(no prefill pool) behind the router. The worker serving a long greedy stream is hung
(SIGSTOP) or killed (SIGKILL) mid-stream; the client must still receive exactly the
engine's text, the router must count the failover and route around the dead worker,
and re-admit the hung one once it answers again."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from cluster.config import ClusterConfig
from cluster.local.workers import LocalWorkers
from cluster.serve import build
from engine import LLM, SamplingParams
from router.app import WORKER_HEADER
from tests.http_server import free_port, serving

PROMPT = "Paged attention stores keys and values in fixed-size blocks."
MAX_TOKENS = 240  # long enough that the stream is still going when its worker is stopped


@pytest.fixture(scope="module")
def server(llama_dir: Path) -> Iterator[tuple[str, LocalWorkers]]:
    # Fast detection keeps the test short; round_robin makes the re-admitted worker's
    # next turn predictable.
    config = ClusterConfig.from_dict({
        "model": str(llama_dir), "transport": "shm",
        "router": {"port": free_port(), "policy": "round_robin", "health_interval_s": 0.2,
                   "worker_timeout_s": 1.0},
        "prefill": {"replicas": 0},
        "decode": {"replicas": 2, "engine": {"num_kv_blocks": 64, "num_threads": 1}}})
    workers, router = build(config)
    try:
        with serving(router, config.router.port) as base:
            yield base, workers
    finally:
        for w in workers.decode:  # a failed test may leave one stopped: let stop() end it
            if w.process.is_alive():
                os.kill(w.process.pid, signal.SIGCONT)
        workers.stop()


@pytest.fixture(scope="module")
def expected(llama_dir: Path) -> str:
    llm = LLM(str(llama_dir), num_kv_blocks=64)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].text


def stream(base: str, on_first_chunk: Callable[[str], None]) -> tuple[str, int]:
    """The streamed completion's text and chunk count; on_first_chunk(worker name) runs
    as soon as the first chunk arrives, while the rest is still being generated."""
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "stream": True}
    parts: list[str] = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        worker = response.headers[WORKER_HEADER]
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            parts.append(json.loads(line[6:])["choices"][0]["text"])
            if len(parts) == 1:
                on_first_chunk(worker)
    return "".join(parts), len(parts)


def metric(base: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", httpx.get(f"{base}/metrics", timeout=10).text, re.M)
    assert found, f"{name} missing from /metrics"
    return float(found.group(1))


def pid_of(workers: LocalWorkers, name: str) -> int:
    return next(w.process.pid for w in workers.decode if w.name == name)


def served_by(base: str) -> str:
    r = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0.0},
                   timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    return r.headers[WORKER_HEADER]


@pytest.mark.timeout(120)
def test_a_hung_worker_fails_over_and_is_readmitted(server, expected: str) -> None:
    base, workers = server
    before = metric(base, "pdserve_decode_failovers_total")
    hung: list[str] = []

    def hang(worker: str) -> None:
        os.kill(pid_of(workers, worker), signal.SIGSTOP)
        hung.append(worker)

    try:
        text, _ = stream(base, hang)
        assert text == expected
        assert metric(base, "pdserve_decode_failovers_total") == before + 1
        assert metric(base, "pdserve_decode_workers_live") == 1
        # New requests avoid the hung worker.
        assert {served_by(base), served_by(base)} == {w.name for w in workers.decode} - set(hung)
    finally:
        for name in hung:
            os.kill(pid_of(workers, name), signal.SIGCONT)
    end = time.monotonic() + 10
    while metric(base, "pdserve_decode_workers_live") != 2:
        assert time.monotonic() < end, "the resumed worker was not re-admitted within 10 s"
        time.sleep(0.1)
    # round_robin: within two requests the re-admitted worker serves one again.
    assert hung[0] in {served_by(base), served_by(base)}


@pytest.mark.timeout(120)
def test_a_killed_worker_mid_stream_fails_over_to_the_other(server, expected: str) -> None:
    base, workers = server
    before = metric(base, "pdserve_decode_failovers_total")
    killed: list[str] = []

    def kill(worker: str) -> None:
        os.kill(pid_of(workers, worker), signal.SIGKILL)
        killed.append(worker)

    text, chunks = stream(base, kill)
    assert killed and text == expected and chunks > 1
    assert metric(base, "pdserve_decode_failovers_total") == before + 1
    assert metric(base, "pdserve_decode_workers_live") == 1
    # A later request, streamed or not, is served by the survivor.
    assert served_by(base) != killed[0]
    again, _ = stream(base, lambda worker: None)
    assert again == expected
