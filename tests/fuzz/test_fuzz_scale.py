"""A short seeded run of the scale fuzzer (tests/fuzz/scale.py) on one local 1P1D
deployment of worker processes: random scale events while random greedy requests run,
every answer equal to the colocated oracle's. More seeds: benchmarks/fuzz/scale.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.config import ClusterConfig
from cluster.serve import build
from tests.fuzz.common import Oracle
from tests.fuzz.scale import run_scale_seed
from tests.http_server import free_port, serving

# Each scale event starts or stops a worker process: seconds each. Seed 7 has a grow,
# a shift that must drain first (2P1D -> 1P2D under max_workers 3) and a refusal.
SEEDS = (7,)


def scale_config(model_dir: Path) -> ClusterConfig:
    return ClusterConfig.from_dict({
        "model": str(model_dir), "transport": "shm", "prefill_deadline_s": 5.0,
        "router": {"port": free_port(), "remote_prefill_min_tokens": 16, "access_log": False},
        "prefill": {"replicas": 1, "engine": {"num_kv_blocks": 96, "max_num_batched_tokens": 64}},
        "decode": {"replicas": 1, "engine": {"num_kv_blocks": 96, "max_num_seqs": 4}},
        # 3 of 4: a shift such as 2P1D -> 1P2D drains before it starts (cluster/elastic.py)
        "autoscale": {"prefill": {"min": 0, "max": 2}, "decode": {"min": 1, "max": 2}, "max_workers": 3}})


@pytest.fixture(scope="module")
def deployment(llama_dir: Path) -> Iterator[tuple[str, ClusterConfig, object]]:
    config = scale_config(llama_dir)
    workers, router = build(config)
    try:
        with serving(router, config.router.port) as base:
            yield base, config, router
    finally:
        workers.stop()


@pytest.mark.timeout(400)
def test_random_scale_events_change_no_answer(deployment, llama_dir: Path) -> None:
    base, config, router = deployment
    oracle = Oracle(llama_dir)
    logging.disable(logging.WARNING)  # drains, moves and fallbacks are expected here
    try:
        runs = [run_scale_seed(seed, base, config.model, router.scaler, oracle) for seed in SEEDS]
    finally:
        logging.disable(logging.NOTSET)
    failures = [f for r in runs for f in r.failures]
    assert failures == []
    assert sum(r.requests for r in runs) == 16 * len(SEEDS)
    sizes = [tuple(e["result"][p] for p in ("prefill", "decode")) for r in runs for e in r.events if "result" in e]
    assert len(set(sizes)) > 1, sizes  # the pools did change
    assert sum(len(r.events) for r in runs) == 3 * len(SEEDS)
