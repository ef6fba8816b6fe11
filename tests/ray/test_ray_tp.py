"""A tensor-parallel worker on Ray (private local Ray, CPU, a tiny model): its actor and
its follower rank get one placement-group bundle each, in a group of their own packed
on one node (STRICT_PACK); it serves the offline engine's tokens, KV pushed from a TP 1
prefill worker; and nothing it started outlives the deployment."""

from __future__ import annotations

from pathlib import Path

import httpx2 as httpx
import pytest
import ray
from ray.util import placement_group_table

from cluster.config import ClusterConfig
from cluster.ray.workers import RayWorkers
from cluster.serve import build
from engine import LLM, SamplingParams
from tests.http_server import free_port, serving
from tests.ray.conftest import assert_ray_gone, descendants

PROMPT = "Paged attention stores keys and values in fixed-size blocks."


@pytest.mark.timeout(300)
def test_a_tp_worker_is_one_strict_pack_group_with_a_bundle_per_rank(llama_dir: Path) -> None:
    assert not ray.is_initialized(), "another test left Ray connected in this process"
    before = descendants()
    config = ClusterConfig.from_dict({
        "model": str(llama_dir), "transport": "shm", "launcher": "ray",
        "ray": {"address": "local", "num_cpus": 3},
        "router": {"port": free_port(), "remote_prefill_min_tokens": 4},
        "prefill": {"replicas": 1, "engine": {"num_kv_blocks": 64, "num_threads": 1}},
        "decode": {"replicas": 1, "engine": {"num_kv_blocks": 64, "num_threads": 1, "tensor_parallel_size": 2}}})
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = LLM(str(llama_dir), num_kv_blocks=64).generate([PROMPT], params, use_tqdm=False)[0].text
    workers, router = build(config)
    try:
        assert isinstance(workers, RayWorkers)
        groups = [placement_group_table(group) for group in workers.groups]
        shapes = sorted((g["strategy"], list(g["bundles"].values())) for g in groups)
        assert shapes == [("PACK", [{"CPU": 1.0}]), ("STRICT_PACK", [{"CPU": 1.0}, {"CPU": 1.0}])]
        with serving(router, config.router.port) as base:
            body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
            decode = httpx.get(f"{base}/status", timeout=10).json()["decode_workers"][0]["stats"]
            assert len(decode["ranks"]) == 2 and decode["remote"] == 1
    finally:
        workers.stop()
    assert_ray_gone(before, "processes")
