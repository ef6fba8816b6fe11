"""What each tensor-parallel rank holds: the ranges, the loader's slices (read alone,
never the whole tensor), and one step's broadcast form."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import numpy as np
import pytest
import safetensors
import torch

from engine.attention.backend import get_backend
from engine.distributed.sharding import Shard, check_shardable, kv_head_range
from engine.distributed.step_codec import StepCodec
from engine.model.config import ModelConfig
from engine.model.loader import load_model
from engine.request import Request
from engine.runner import build_step_inputs
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ScheduledRequest


def test_kv_heads_split_or_replicate() -> None:
    assert [kv_head_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(1, 2, r) for r in range(2)] == [(0, 1), (0, 1)]


def test_ranges_and_vocabulary_padding(tiny_models: dict[str, Path]) -> None:
    cfg = dataclasses.replace(ModelConfig.from_model_dir(tiny_models["llama"]), vocab_size=385)
    shards = [Shard.of(cfg, r, 2) for r in range(2)]
    assert [s.q_heads for s in shards] == [(0, 2), (2, 4)]
    assert [s.intermediate for s in shards] == [(0, 64), (64, 128)]
    assert [s.vocab for s in shards] == [(0, 193), (193, 386)]  # the last row is padding


@pytest.mark.parametrize("size,message", [(3, "4 attention heads do not divide by tensor_parallel_size 3"),
                                          (8, "4 attention heads do not divide")])
def test_unshardable_sizes_are_named(tiny_models: dict[str, Path], size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_shardable(ModelConfig.from_model_dir(tiny_models["llama"]), size)


def test_each_rank_loads_its_slices_and_reads_only_them(tiny_models: dict[str, Path], monkeypatch) -> None:
    model_dir = tiny_models["qwen2"]  # qkv biases, untied lm_head
    cfg = ModelConfig.from_model_dir(model_dir)
    backend = get_backend("torch", "cpu")
    full = load_model(model_dir, cfg, "float32", "cpu", backend, 256)
    read_whole: list[str] = []
    original = safetensors.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.f = original(*args, **kwargs)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read_whole.append(name)
            return self.inner.get_tensor(name)

        def get_slice(self, name):
            return self.inner.get_slice(name)

    monkeypatch.setattr("engine.model.loader.safe_open", Spy)
    d, q, kv, inter = cfg.head_dim, 2 * cfg.head_dim, cfg.head_dim, 64
    for rank in range(2):
        part = load_model(model_dir, cfg, "float32", "cpu", backend, 256, Shard.of(cfg, rank, 2))
        attn, full_attn = part.layers[0].self_attn, full.layers[0].self_attn
        qkv, full_qkv = attn.qkv_proj.weight, full_attn.qkv_proj.weight
        Q, KV = cfg.num_heads * d, cfg.num_kv_heads * d
        assert torch.equal(qkv[:q], full_qkv[rank * q:(rank + 1) * q])
        assert torch.equal(qkv[q:q + kv], full_qkv[Q + rank * kv:Q + (rank + 1) * kv])
        assert torch.equal(qkv[q + kv:], full_qkv[Q + KV + rank * kv:Q + KV + (rank + 1) * kv])
        assert torch.equal(attn.qkv_proj.bias[:q], full_attn.qkv_proj.bias[rank * q:(rank + 1) * q])
        assert torch.equal(attn.o_proj.weight, full_attn.o_proj.weight[:, rank * q:(rank + 1) * q])
        mlp, full_mlp = part.layers[1].mlp, full.layers[1].mlp
        assert torch.equal(mlp.gate_up_proj.weight[inter:], full_mlp.gate_up_proj.weight[128 + rank * inter:128 + (rank + 1) * inter])
        assert torch.equal(mlp.down_proj.weight, full_mlp.down_proj.weight[:, rank * inter:(rank + 1) * inter])
        assert torch.equal(part.embed_tokens.weight, full.embed_tokens.weight[rank * 192:(rank + 1) * 192])
        assert torch.equal(part.lm_head.weight, full.lm_head.weight[rank * 192:(rank + 1) * 192])
        assert torch.equal(part.norm.weight, full.norm.weight)
    # Whole tensors were read only where a rank holds all of them (norms).
    assert read_whole and all("norm" in name for name in read_whole)


def test_a_step_survives_its_broadcast_form() -> None:
    reqs = [Request(f"r{i}", list(range(2, 2 + n)), SamplingParams()) for i, n in enumerate([5, 40, 1])]
    scheduled = [ScheduledRequest(reqs[0], 0, 5, True), ScheduledRequest(reqs[1], 16, 24, False),
                 ScheduledRequest(reqs[2], 0, 1, True)]
    tables = np.array([[3, 0, 0, 0], [4, 5, 6, 0], [7, 0, 0, 0]], dtype=np.int32)
    inputs = build_step_inputs(scheduled, tables, 16)
    codec = StepCodec(max_tokens=64, max_seqs=4, block_size=16, max_model_len=64)
    back = codec.decode(codec.encode(inputs, codec.buffer()))
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "logits_indices"):
        assert np.array_equal(getattr(back, name), getattr(inputs, name)), name
    assert np.array_equal(back.block_tables, tables[:, :3])  # the columns the step reads
    assert back.query_lens == inputs.query_lens
    assert back.block_copies.shape == (0, 2)
    inputs.block_copies = np.array([[3, 7], [3, 9]])  # a forked sequence's shared block, copied on write
    assert np.array_equal(codec.decode(codec.encode(inputs, codec.buffer())).block_copies, [[3, 7], [3, 9]])
    with pytest.raises(Exception, match="beyond the broadcast buffer"):
        StepCodec(max_tokens=8, max_seqs=4, block_size=16, max_model_len=64).encode(inputs, codec.buffer())


def test_fused_checkpoint_tensors_and_projection_norms_are_cut_per_rank(tiny_models: dict[str, Path]) -> None:
    """Phi-3's checkpoint holds qkv_proj and gate_up_proj fused: a rank takes its q, k
    and v rows, and its gate and up rows, out of them. OLMo 2's q/k norm weights span
    every head: a rank takes its heads' part."""
    backend = get_backend("torch", "cpu")
    for arch in ("phi3", "olmo2"):
        cfg = ModelConfig.from_model_dir(tiny_models[arch])
        full = load_model(tiny_models[arch], cfg, "float32", "cpu", backend, 256)
        d, inter = cfg.head_dim, cfg.intermediate_size // 2
        Q, KV, q, kv = cfg.num_heads * d, cfg.num_kv_heads * d, 2 * d, d
        for rank in range(2):
            part = load_model(tiny_models[arch], cfg, "float32", "cpu", backend, 256, Shard.of(cfg, rank, 2))
            attn, full_attn = part.layers[1].self_attn, full.layers[1].self_attn
            qkv, full_qkv = attn.qkv_proj.weight, full_attn.qkv_proj.weight
            assert torch.equal(qkv, torch.cat([full_qkv[rank * q:(rank + 1) * q],
                                               full_qkv[Q + rank * kv:Q + (rank + 1) * kv],
                                               full_qkv[Q + KV + rank * kv:Q + KV + (rank + 1) * kv]]))
            gate_up, full_gate_up = part.layers[1].mlp.gate_up_proj.weight, full.layers[1].mlp.gate_up_proj.weight
            gate, up = full_gate_up.split(2 * inter)
            assert torch.equal(gate_up, torch.cat([gate[rank * inter:(rank + 1) * inter],
                                                   up[rank * inter:(rank + 1) * inter]]))
            if arch == "olmo2":
                assert torch.equal(attn.q_norm.weight, full_attn.q_norm.weight[rank * q:(rank + 1) * q])
                assert torch.equal(attn.k_norm.weight, full_attn.k_norm.weight[rank * kv:(rank + 1) * kv])
    with safetensors.safe_open(str(tiny_models["phi3"] / "model.safetensors"), "pt") as f:  # fused as Phi-3's are
        assert {"model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"} <= set(f.keys())


@pytest.mark.parametrize("num_kv_heads", [2, 1])  # 1: the one KV head on both ranks, its k summed once
def test_whole_projection_norms_sum_every_rank_once(tiny_models: dict[str, Path], num_kv_heads: int) -> None:
    """OLMo 2's q/k norms at TP 2 (two gloo ranks as threads) equal the one-rank norms
    over whole projections, each rank's heads' part."""
    from engine.distributed.group import SINGLE, TorchGroup
    from engine.model.norm import RMSNorm
    from engine.model.olmo2 import ProjectionQKNorm
    from tests.http_server import free_port

    cfg = dataclasses.replace(ModelConfig.from_model_dir(tiny_models["olmo2"]), num_kv_heads=num_kv_heads)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 16, generator=g), torch.randn(5, num_kv_heads, 16, generator=g)
    q_norm, k_norm = RMSNorm(64, 1e-6), RMSNorm(num_kv_heads * 16, 1e-6)
    q_norm.weight.data = torch.rand(64, generator=g) + 0.5
    k_norm.weight.data = torch.rand(num_kv_heads * 16, generator=g) + 0.5

    def whole(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:  # transformers' Olmo2RMSNorm over all heads
        flat = x.reshape(5, -1)
        return (norm.weight * (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6))).view(x.shape)

    want_q, want_k = whole(q, q_norm), whole(k, k_norm)
    one_rank = ProjectionQKNorm(cfg, Shard.of(cfg), SINGLE)(q, k, q_norm, k_norm)
    assert torch.equal(one_rank[0], want_q) and torch.equal(one_rank[1], want_k)
    port, results, errors = free_port(), {}, []

    def rank(r: int) -> None:
        try:
            shard = Shard.of(cfg, r, 2)
            (q0, q1), (k0, k1) = shard.q_heads, shard.kv_heads
            qn, kn = RMSNorm((q1 - q0) * 16, 1e-6), RMSNorm((k1 - k0) * 16, 1e-6)
            qn.weight.data = q_norm.weight.data[q0 * 16:q1 * 16]
            kn.weight.data = k_norm.weight.data[k0 * 16:k1 * 16]
            group = TorchGroup(r, 2, port, 30.0, torch.device("cpu"))
            try:
                results[r] = ProjectionQKNorm(cfg, shard, group)(q[:, q0:q1], k[:, k0:k1], qn, kn), shard
            finally:
                group.close()
        except Exception as exc:  # reported below, from the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 2, errors
    for (got_q, got_k), shard in results.values():
        torch.testing.assert_close(got_q, want_q[:, shard.q_heads[0]:shard.q_heads[1]], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_k, want_k[:, shard.kv_heads[0]:shard.kv_heads[1]], rtol=1e-6, atol=1e-6)
