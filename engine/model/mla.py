"""Multi-head latent attention (DeepSeek-V2/V3), absorbed, over a latent KV cache.

Per token the model projects one latent c (kv_lora_rank wide, RMS-normed) and one
rotary key k_r (qk_rope_head_dim) shared by every head; head h's key is
[W_UK[h] c, k_r] and its value W_UV[h] c, W_UK and W_UV being kv_b_proj's rows. The
cache keeps only [c, k_r] (engine/kv_cache/layout.py: one plane, one "KV head").

Absorbed: q_h . [W_UK[h] c, k_r] = [W_UK[h]^T q_nope_h, q_rope_h] . [c, k_r], so each
head's query is folded into the latent space once, and attention is multi-query
attention of the H heads over the cached [c, k_r] vectors. Its value is c: the
backends attend with the latent as key and as value (the layout's V plane is the K
plane), and the rope dims of the output are dropped; W_UV then maps each head's
latent output to its value space. Prefill, decode, chunks over a cached prefix and
speculative verify rows all take this one path, through whatever attention backend the
engine runs, so every cache feature works on the latent cache unchanged.

Tensor parallel: the query, kv_b_proj and o_proj are split by heads; the latent
projections are replicated, so every rank computes, and caches, the whole latent.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.kv_quant import is_fp8, round_to_cache
from engine.attention.metadata import current_metadata
from engine.distributed.group import Group
from engine.distributed.sharding import Shard
from engine.model.config import MLAConfig, ModelConfig
from engine.model.norm import RMSNorm
from engine.model.rope import RotaryTables, apply_rotary, yarn_mscale

LORA_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with its default eps


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim ** -0.5, times yarn's mscale(mscale_all_dim) squared where set."""
    assert cfg.mla is not None
    scale = cfg.mla.qk_head_dim ** -0.5
    rope = cfg.rope_scaling
    if rope is not None and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rope dims in pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...), the
    rotate-half order, for query and key alike (so their products are unchanged)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def rotate(mla: MLAConfig, q_rope: torch.Tensor, k_rope: torch.Tensor,
           rotary: tuple[torch.Tensor, torch.Tensor] | RotaryTables) -> tuple[torch.Tensor, torch.Tensor]:
    """q_rope [T, H, r], k_rope [T, 1, r] rotated (in the rotate-half order), in their
    dtype; computed in float32 and rounded once where transformers does (V2)."""
    dtype = q_rope.dtype
    if mla.rope_interleave:
        q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
    rope_dtype = torch.float32 if mla.rope_fp32 else dtype
    if isinstance(rotary, RotaryTables):  # the fused path's tables: looked up here
        cos = rotary.cos[rotary.positions].to(rope_dtype)[:, None, :]
        sin = rotary.sin[rotary.positions].to(rope_dtype)[:, None, :]
    else:
        cos, sin = rotary
    q_rope, k_rope = apply_rotary(q_rope.to(rope_dtype), k_rope.to(rope_dtype), cos, sin)
    return q_rope.to(dtype), k_rope.to(dtype)


class LatentUpProjection(nn.Module):
    """kv_b_proj's weight, [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]: never
    applied as a linear (absorbed), so not an nn.Linear a CPU prepack would replace."""

    def __init__(self, num_heads: int, mla: MLAConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank))


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, shard: Shard, group: Group) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None, "MLAttention needs the model's MLAConfig"
        self.mla, self.group, self.backend = mla, group, backend
        self.num_heads = shard.num_q_heads
        q_out = self.num_heads * mla.qk_head_dim
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, mla.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, mla.latent_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = LatentUpProjection(self.num_heads, mla)
        self.o_proj = nn.Linear(self.num_heads * mla.v_head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.scale = softmax_scale(cfg)
        self.layer_cache: torch.Tensor | None = None  # [num_blocks, 2, bs, 1, latent] view, bound by the runner
        self.k_scale = 1.0  # an fp8 cache holds latent / k_scale (attention/kv_quant.py); it is K and V alike

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(x)
        assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, rotary: tuple[torch.Tensor, torch.Tensor] | RotaryTables, x: torch.Tensor) -> torch.Tensor:
        mla, t, heads = self.mla, x.shape[0], self.num_heads
        q_nope, q_rope = self._query(x).view(t, heads, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope, k_rope = rotate(mla, q_rope, k_rope[:, None, :], rotary)
        w_kv = self.kv_b_proj.weight.view(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        w_uk, w_uv = w_kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, kv_lora_rank]
        query = torch.cat((q_latent, q_rope), dim=-1)  # [T, H, latent_dim]
        key = torch.cat((latent[:, None, :], k_rope), dim=-1)  # [T, 1, latent_dim]
        md = current_metadata()
        assert self.layer_cache is not None, "KV cache not bound to the model"
        cache, scale = self.layer_cache, self.scale
        if is_fp8(cache.dtype):  # the latent is the key and the value: its scale goes on both sides
            key, scale = round_to_cache(key, self.k_scale, cache.dtype), scale * self.k_scale
        o = self.backend.latent_attention(query, key, cache, md, scale, mla.kv_lora_rank)
        if is_fp8(cache.dtype) and self.k_scale != 1.0:
            o = o * self.k_scale
        o = torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, v_head_dim]
        return self.group.all_reduce_(self.o_proj(o.transpose(0, 1).reshape(t, heads * mla.v_head_dim)))
