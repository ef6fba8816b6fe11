"""configs/ray-multinode.yaml's shape on two Ray nodes: the prefill pool on the node
with `prefill_node`, the decode pool on the one with `decode_node`, KV pushed between
them by nixl. Both nodes are raylets of this machine (Ray's own cluster_utils, on
127.0.0.1), so each worker listens on its node's address and nothing is shared but the
network; a GPU is not needed (CPU, float32)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util import placement_group_table

from cluster.config import PoolConfig, RayPoolConfig, RouterConfig, load_cluster_config
from cluster.ray.workers import RayWorkers
from cluster.serve import build
from engine import LLM, SamplingParams
from tests.disagg.test_worker_processes import Client
from tests.http_server import free_port, serving
from tests.ray.conftest import REPO, descendants

pytest.importorskip("nixl._api", reason="the nixl transport needs the nixl package")

LONG_PROMPT = "Paged attention keeps keys and values in fixed-size blocks of the cache. " * 6
PARAMS = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def deployment(llama_dir: Path) -> Iterator[tuple[str, RayWorkers, Cluster]]:
    assert not ray.is_initialized(), "another test left Ray connected in this process"
    before = descendants()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"decode_node": 1}, "object_store_memory": 128 << 20,
        "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"prefill_node": 1}, object_store_memory=128 << 20)
    workers = None
    try:
        with pytest.MonkeyPatch.context() as env:  # the config binds 0.0.0.0: it reads its API keys
            env.setenv("PDSERVE_API_KEYS", "sk-test")
            shape = load_cluster_config(REPO / "configs" / "ray-multinode.yaml")
        pool = dict(num_cpus=1.0, num_gpus=0.0)
        config = dataclasses.replace(
            shape, model=str(llama_dir), dtype="float32", device="cpu",
            ray=dataclasses.replace(shape.ray, address=cluster.address, placement_timeout_s=30.0,
                                    prefill=RayPoolConfig(**pool, resources={"prefill_node": 1.0}),
                                    decode=RayPoolConfig(**pool, resources={"decode_node": 1.0})),
            router=RouterConfig(port=free_port(), remote_prefill_min_tokens=32),
            prefill=PoolConfig(replicas=1, engine={"num_kv_blocks": 64, "num_threads": 1}),
            decode=PoolConfig(replicas=1, engine={"num_kv_blocks": 64, "num_threads": 1}))
        assert config.transport == "nixl" and config.ray.strategy == "SPREAD"
        workers, router = build(config)
        with serving(router, config.router.port) as base:
            yield base, workers, cluster
    finally:
        if workers is not None:
            workers.stop()
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    end = time.monotonic() + 15
    while descendants() - before and time.monotonic() < end:
        time.sleep(0.2)
    assert not descendants() - before, "the two-node Ray outlived the test"


@pytest.mark.timeout(240)
def test_pools_on_their_nodes_push_kv_between_nodes(deployment, llama_dir: Path) -> None:
    import httpx2 as httpx

    base, workers, cluster = deployment
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    placed = {}
    for group in workers.groups:  # one per pool, one bundle per worker
        table = placement_group_table(group)
        (node,) = set(table["bundles_to_node_id"].values())
        (resource,) = {k for k in nodes[node] if k.endswith("_node")}
        placed[resource] = node
    assert placed.keys() == {"decode_node", "prefill_node"} and placed["decode_node"] != placed["prefill_node"]
    assert all(w.address.startswith("tcp://127.0.0.1:") for w in workers.all)

    expected = LLM(str(llama_dir), num_kv_blocks=64).generate([LONG_PROMPT], SamplingParams(**PARAMS),
                                                              use_tqdm=False)[0].text
    stats = Client(workers.decode[0].address, workers.secret)
    try:
        before = stats.stats()
        start = time.monotonic()
        r = httpx.post(f"{base}/v1/completions", json={"prompt": LONG_PROMPT, **PARAMS}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        after = stats.stats()
    finally:
        stats.close()
    assert time.monotonic() - start < 30
    # Its KV came from the prefill worker on the other node, over nixl.
    assert after.remote == before.remote + 1 and after.fallbacks == before.fallbacks
    assert after.kv_bytes_received > before.kv_bytes_received
