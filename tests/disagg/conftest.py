"""Fixtures of the disaggregation tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import openai
import pytest

from cluster.config import ClusterConfig
from cluster.local.workers import LocalWorkers
from cluster.serve import build
from engine import LLM
from tests.disagg.test_remote_prefill import GREEDY, PROMPTS
from tests.http_server import free_port, serving


class Served(NamedTuple):
    client: openai.OpenAI
    config: ClusterConfig
    workers: LocalWorkers
    base: str  # the router's base URL


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> dict[str, list[int]]:
    """The colocated engine's greedy tokens for test_remote_prefill.PROMPTS, by request id."""
    llm = LLM(str(llama_dir), num_kv_blocks=80)
    return {f"r{i}": o.token_ids for i, o in enumerate(llm.generate(PROMPTS, GREEDY, use_tqdm=False))}


@pytest.fixture(scope="session")
def pd_server(llama_dir: Path) -> Iterator[Served]:
    """1 prefill + 1 decode worker process (shm) behind the router over real HTTP, shared
    by the modules that need nothing else (test_http, test_parallel_sampling,
    test_worker_plane_auth): one start instead of three in one process (an xdist worker
    starts it once for those of them it runs). Their tests count from what they see
    first, not from zero; none leaves a request running."""
    config = ClusterConfig.from_dict({
        "model": str(llama_dir), "transport": "shm", "prefill_deadline_s": 5.0,
        "router": {"port": free_port(), "remote_prefill_min_tokens": 8, "max_queued_requests": 64},
        "prefill": {"replicas": 1, "engine": {"num_kv_blocks": 80, "max_num_batched_tokens": 32}},
        "decode": {"replicas": 1, "engine": {"num_kv_blocks": 80}}})
    workers, router = build(config)
    try:
        with serving(router, config.router.port) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=60, max_retries=0)
            yield Served(client, config, workers, base)
    finally:
        workers.stop()
