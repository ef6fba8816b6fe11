"""The one-GPU configs: 1 prefill + 1 decode worker over cuda_ipc, its nixl variant (the
same but the transport), and its colocated twin (one engine with the same memory)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from cluster.config import load_cluster_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_the_gpu_configs_are_twins() -> None:
    disagg = load_cluster_config(CONFIGS / "gpu-1p1d.yaml")
    nixl = load_cluster_config(CONFIGS / "gpu-1p1d-nixl.yaml")
    coloc = load_cluster_config(CONFIGS / "gpu-colocated.yaml")
    assert (disagg.device, disagg.dtype, disagg.launcher, disagg.transport) == ("cuda", "bfloat16", "local", "cuda_ipc")
    assert (disagg.prefill.replicas, disagg.decode.replicas, coloc.prefill.replicas, coloc.decode.replicas) == (1, 1, 0, 1)
    assert dataclasses.replace(nixl, transport="cuda_ipc") == disagg
    share = {role: disagg.engine_config(role).gpu_memory_utilization for role in ("prefill", "decode")}
    colocated = coloc.engine_config("decode")
    assert colocated.gpu_memory_utilization == share["prefill"] + share["decode"] < 0.9
    decode = disagg.engine_config("decode")
    assert (colocated.max_num_seqs, colocated.max_num_batched_tokens) == (decode.max_num_seqs, decode.max_num_batched_tokens)
    assert (coloc.model, coloc.dtype, coloc.device) == (disagg.model, disagg.dtype, disagg.device)
