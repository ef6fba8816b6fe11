"""Disaggregated prefill of mixtures of experts between workers of different TP sizes,
with and without expert parallelism on either side: greedy tokens equal the colocated
engine's. Qwen3-MoE's dense attention moves by the per-head plan; DeepSeek-V3's latent
cache (MLA: one latent "head" every rank holds whole) moves as whole blocks, each
destination rank's from one source rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from decode_worker.remote_kv import DecodeWorkerCore
from engine import LLM
from kv_transfer import TransportConfig, create_transport
from prefill_worker.remote_prefill import PrefillWorkerCore
from tests.disagg.test_remote_prefill import GREEDY, PROMPTS, run, tokens
from tests.disagg.test_tp_remote_prefill import tp_engine


@pytest.fixture(scope="module")
def moe_reference(moe_models: dict[str, Path]) -> dict[str, dict[str, list[int]]]:
    refs = {}
    for arch in ("qwen3_moe", "deepseek_v3"):
        llm = LLM(str(moe_models[arch]), num_kv_blocks=80)
        refs[arch] = {f"r{i}": o.token_ids for i, o in enumerate(llm.generate(PROMPTS, GREEDY, use_tqdm=False))}
    return refs


@pytest.mark.timeout(240)
@pytest.mark.parametrize("arch,transport,prefill,decode", [
    ("qwen3_moe", "shm", (1, False), (2, True)),  # into a decode worker whose ranks hold 4 experts each
    ("qwen3_moe", "tcp", (2, True), (1, False)),
    ("qwen3_moe", "shm", (2, False), (2, True)),
    ("deepseek_v3", "shm", (1, False), (2, True)),  # both decode ranks get rank 0's whole latent blocks
    ("deepseek_v3", "tcp", (1, False), (2, False)),
    ("deepseek_v3", "shm", (2, True), (1, False)),  # one of the two prefill ranks' copies
    ("deepseek_v3", "tcp", (2, False), (1, False)),
    ("deepseek_v3", "shm", (2, False), (2, True)),
    ("deepseek_v3", "tcp", (2, True), (2, False)),
])
def test_pushed_moe_kv_between_tp_and_ep_workers_gives_colocated_tokens(
        moe_models: dict[str, Path], moe_reference, arch: str, transport: str, prefill: tuple[int, bool],
        decode: tuple[int, bool]) -> None:
    model = moe_models[arch]
    config = TransportConfig(timeout_s=10.0, cancel_grace_s=5.0)
    t_dec, t_pre = create_transport(transport, "decode", config), create_transport(transport, "prefill", config)
    engines = []
    try:
        engines.append(tp_engine(model, t_dec, decode[0], num_kv_blocks=80, enable_expert_parallel=decode[1]))
        engines.append(tp_engine(model, t_pre, prefill[0], num_kv_blocks=80, max_num_batched_tokens=24,
                                 enable_expert_parallel=prefill[1]))
        t_pre.add_peer(t_dec.metadata())
        decode_core, prefill_core = DecodeWorkerCore(engines[0], t_dec, 30.0), PrefillWorkerCore(engines[1], t_pre)
        done = run(decode_core, prefill_core, PROMPTS, timeout=120)
        assert tokens(done) == moe_reference[arch]
        assert decode_core.stats["remote"] == len(PROMPTS) and decode_core.stats["fallbacks"] == 0
        for core in engines:
            assert core.kv.num_free_blocks == core.kv.pool.num_blocks, "blocks leaked"
    finally:
        t_dec.close()
        t_pre.close()
        for core in engines:
            core.close()
