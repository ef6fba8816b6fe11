"""The planner on a real local deployment (tiny model, worker processes, HTTP), with
short timescales: it adds a decode worker under a decode-heavy ramp, a prefill worker
under a prefill-heavy one, and takes both back to their minimum when idle; no request
fails on the way, and each decision is in /metrics with its reason."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from cluster.autoscale.run import start_planner
from cluster.config import ClusterConfig
from cluster.serve import build
from tests.http_server import free_port, serving

LONG_PROMPT = "Disaggregated serving computes the prompt on one worker and decodes on another. " * 12


@pytest.fixture(scope="module")
def deployment(llama_dir: Path) -> Iterator[tuple[str, ClusterConfig, object]]:
    config = ClusterConfig.from_dict({
        "model": str(llama_dir), "transport": "shm", "prefill_deadline_s": 10.0,
        "router": {"port": free_port(), "remote_prefill_min_tokens": 32},
        # Small engines, so that a few clients make a queue.
        "prefill": {"replicas": 1, "engine": {"num_kv_blocks": 128, "max_num_batched_tokens": 32}},
        "decode": {"replicas": 1, "engine": {"num_kv_blocks": 128, "max_num_seqs": 2}},
        "autoscale": {"enabled": True, "prefill": {"min": 1, "max": 2}, "decode": {"min": 1, "max": 2},
                      "interval_s": 0.5, "window_s": 2.0, "scale_up_cooldown_s": 2.0, "scale_down_cooldown_s": 3.0,
                      "ttft_p90_s": 30.0, "tpot_p90_s": 5.0, "queue_high": 1.0, "prefill_jobs_high": 1.0,
                      "drain_timeout_s": 10.0}})
    workers, router = build(config)
    try:
        with serving(router, config.router.port) as base:
            planner = start_planner(config, router)
            try:
                yield base, config, router
            finally:
                planner.stop()
    finally:
        workers.stop()


class Load:
    """`clients` threads sending one request after another until stopped; every answer
    must be a whole one."""

    def __init__(self, base: str, model: str, prompt: str, max_tokens: int, clients: int) -> None:
        self.stop, self.done, self.errors = threading.Event(), 0, []
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=120, max_retries=0)

        def run() -> None:
            while not self.stop.is_set():
                try:  # each prompt its own: a prefix-cache hit would leave nothing to prefill
                    out = client.completions.create(model=model, prompt=f"{time.monotonic_ns()} {prompt}",
                                                    max_tokens=max_tokens,
                                                    temperature=0.0, extra_body={"ignore_eos": True})
                    assert out.usage.completion_tokens == max_tokens
                    self.done += 1
                except Exception as exc:  # noqa: BLE001 - every failure is the test's finding
                    self.errors.append(repr(exc))
        self.pool = ThreadPoolExecutor(clients)
        self.futures = [self.pool.submit(run) for _ in range(clients)]

    def end(self) -> None:
        self.stop.set()
        for f in self.futures:
            f.result(timeout=120)
        self.pool.shutdown()
        assert self.errors == [] and self.done > 0


def until(condition: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"not within {timeout} s: {what}"
        time.sleep(0.1)


def decisions(base: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("pdserve_autoscale_decisions_total{")}


@pytest.mark.timeout(300)
def test_the_planner_follows_a_decode_ramp_a_prefill_ramp_and_idle_time(deployment) -> None:
    base, config, router = deployment
    sizes = router.scaler.sizes
    assert sizes() == {"prefill": 1, "decode": 1}

    decode_heavy = Load(base, config.model, "Hello", 64, clients=6)  # short prompts, long answers
    until(lambda: sizes()["decode"] == 2, "a decode worker added under the decode-heavy ramp")
    decode_heavy.end()
    assert sizes()["prefill"] == 1  # decode was the bottleneck, not prefill

    prefill_heavy = Load(base, config.model, LONG_PROMPT, 1, clients=6)  # long prompts, one token each
    until(lambda: sizes()["prefill"] == 2, "a prefill worker added under the prefill-heavy ramp")
    prefill_heavy.end()

    until(lambda: sizes() == {"prefill": 1, "decode": 1}, "both pools back to their minimum when idle")
    seen = decisions(base)
    ups = {k for k, v in seen.items() if 'action="up"' in k and v > 0}
    assert any('pool="decode"' in k for k in ups) and any('pool="prefill"' in k for k in ups), seen
    assert any('action="down"' in k and 'reason="idle"' in k for k in seen), seen
