"""Disaggregated prefill between tensor-parallel workers of different sizes: a prefill
worker at TP p pushes into a decode worker at TP d, each rank pair moving only the KV
heads the receiving rank holds. Greedy tokens must equal the colocated engine's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from decode_worker.remote_kv import DecodeWorkerCore
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from kv_transfer import TransportConfig, create_transport
from prefill_worker.remote_prefill import PrefillWorkerCore
from tests.disagg.test_remote_prefill import PROMPTS, run, tokens
from workers.start import register_caches

NIXL = pytest.param("nixl", marks=pytest.mark.skipif(importlib.util.find_spec("nixl") is None,
                                                     reason="the nixl transport needs the nixl package"))


def tp_engine(model_dir: Path, transport, size: int, **options) -> EngineCore:
    engine = EngineCore(EngineConfig(model=str(model_dir), tensor_parallel_size=size, num_threads=1, **options),
                        transport.allocate_kv_cache, keep_cache_files=transport.name == "shm")
    register_caches(transport, engine, "tiny-llama")
    return engine


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["shm", "tcp", NIXL])
@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1), (2, 2)])
def test_pushed_kv_between_tp_sizes_gives_colocated_tokens(llama_dir: Path, reference, transport: str,
                                                           prefill_tp: int, decode_tp: int) -> None:
    config = TransportConfig(timeout_s=10.0, cancel_grace_s=5.0)
    t_dec, t_pre = create_transport(transport, "decode", config), create_transport(transport, "prefill", config)
    engines = []
    try:
        engines.append(tp_engine(llama_dir, t_dec, decode_tp, num_kv_blocks=80))
        # A small token budget: prompts arrive in chunks, so blocks are pushed as they fill.
        engines.append(tp_engine(llama_dir, t_pre, prefill_tp, num_kv_blocks=80, max_num_batched_tokens=24))
        t_pre.add_peer(t_dec.metadata())
        decode, prefill = DecodeWorkerCore(engines[0], t_dec, 30.0), PrefillWorkerCore(engines[1], t_pre)
        done = run(decode, prefill, PROMPTS, timeout=120)
        assert tokens(done) == reference
        assert decode.stats["remote"] == len(PROMPTS) and decode.stats["fallbacks"] == 0
        assert prefill.stats["prefills"] == len(PROMPTS) and prefill.stats["failed"] == 0
        assert t_pre.stats["writes_done"] >= len(PROMPTS) and t_pre.stats["writes_failed"] == 0
        # Block ids are the driver's, the same on every rank: none is left held.
        for core in engines:
            assert core.kv.num_free_blocks == core.kv.pool.num_blocks, "blocks leaked"
            assert len(core.stats().ranks) == core.config.tensor_parallel_size
    finally:
        t_dec.close()
        t_pre.close()
        for core in engines:
            core.close()
