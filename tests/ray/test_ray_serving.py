"""configs/ray-local.yaml served on a private local Ray (1 prefill + 1 decode actor, shm
transport, the demo model): greedy answers equal the offline engine's, long prompts are
prefilled by the prefill actor, and a pool Ray cannot place in time fails, releasing
its placement group."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import openai
import pytest
import ray
from ray.util import placement_group_table

from cluster.config import PoolConfig
from cluster.ray.resources import PlacementError
from cluster.ray.workers import RayWorkers, start_ray_workers
from cluster.serve import build
from engine import LLM, SamplingParams
from tests.disagg.test_worker_processes import Client
from tests.http_server import free_port, serving
from tests.ray.conftest import assert_ray_gone, descendants, ray_local_config

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LONG_PROMPT = "Paged attention keeps keys and values in fixed-size blocks of the cache. " * 8


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[openai.OpenAI, RayWorkers, str]]:
    assert not ray.is_initialized(), "another test left Ray connected in this process"
    before = descendants()
    config = ray_local_config(port=free_port())
    workers, router = build(config)
    assert isinstance(workers, RayWorkers) and ray.is_initialized()
    try:
        with serving(router, config.router.port) as base:
            yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=60, max_retries=0), workers, config.model
    finally:
        workers.stop()
    assert_ray_gone(before)


@pytest.fixture(scope="module")
def expected(served) -> dict[str, str]:
    _, _, model = served
    llm = LLM(model, dtype="float32", device="cpu", num_threads=1, num_kv_blocks=64)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    return {"chat": llm.chat([QUESTION], params, use_tqdm=False)[0].text,
            "long": llm.generate([LONG_PROMPT], params, use_tqdm=False)[0].text}


@pytest.mark.timeout(120)
def test_greedy_answers_equal_the_offline_engine(served, expected: dict[str, str]) -> None:
    client, workers, model = served
    chat = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0.0)
    assert chat.choices[0].message.content == expected["chat"] == "The capital of France is Paris."
    stats = Client(workers.decode[0].address, workers.secret)
    try:
        remote_before = stats.stats().remote
        out = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=12, temperature=0.0)
        assert out.choices[0].text == expected["long"]
        assert stats.stats().remote == remote_before + 1  # its KV came from the prefill actor
    finally:
        stats.close()


@pytest.mark.timeout(60)
def test_pool_ray_cannot_place_in_time_fails_and_releases_its_group(served) -> None:
    # Both CPUs are held by the served pools: capacity exists, placement does not.
    config = ray_local_config(placement_timeout_s=2.0)
    config = dataclasses.replace(config, prefill=PoolConfig(replicas=0))
    groups_before = {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"}
    start = time.monotonic()
    with pytest.raises(PlacementError, match=r"Ray did not place the decode pool\(s\) within 2 s"):
        start_ray_workers(config)
    assert time.monotonic() - start < 10
    assert ray.is_initialized()  # it joined the running Ray, so it leaves it running
    left = {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"}
    assert left == groups_before
