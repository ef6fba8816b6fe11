"""OLMo 2's q/k norms: one RMSNorm over the whole q projection (every head at once,
num_heads * head_dim wide) and one over the whole k projection, before RoPE (Qwen3's
normalise each head alone, model/llama.py). OLMo 2's other difference, its norms after each
sublayer, is DecoderLayer's norm_placement "post".

Under tensor parallelism a rank holds only its heads (and its slice of each norm's
weight, cut by the loader), so the mean of squares needs every rank's sum of squares:
one all-reduce of a [T, 2] float32 tensor per layer, q's and k's sums side by side.
"""

from __future__ import annotations

import torch

from engine.distributed.group import Group
from engine.distributed.sharding import Shard
from engine.model.config import ModelConfig
from engine.model.norm import RMSNorm


class ProjectionQKNorm:
    """Normalises a rank's q and k by the RMS of the whole projections. A plain object:
    the weights are Attention's q_norm and k_norm (the checkpoint's names), each the
    rank's slice of the projection's norm."""

    def __init__(self, cfg: ModelConfig, shard: Shard, group: Group) -> None:
        self.group = group
        self.widths = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
        # With fewer KV heads than ranks each KV head is on size // num_kv_heads ranks
        # (sharding.kv_head_range): only the first of them adds its k sum of squares, so
        # the all-reduce counts each head once.
        replicas = max(1, shard.size // cfg.num_kv_heads)
        self.counts_k = shard.rank % replicas == 0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm,
                 k_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D], the rank's heads -> normalised, [T, Hq, D] and
        [T, Hkv, D] (new tensors)."""
        t = q.shape[0]
        qf, kf = q.reshape(t, -1).float(), k.reshape(t, -1).float()
        if self.group.size == 1:  # transformers' own mean, bit for bit
            q_var, k_var = qf.pow(2).mean(-1, keepdim=True), kf.pow(2).mean(-1, keepdim=True)
        else:
            k_sum = kf.pow(2).sum(-1) if self.counts_k else kf.new_zeros(t)
            sums = self.group.all_reduce_(torch.stack((qf.pow(2).sum(-1), k_sum), dim=-1))  # [T, 2] fp32
            q_var, k_var = sums[:, :1] / self.widths[0], sums[:, 1:] / self.widths[1]
        # Scaled by the weight before the cast, as transformers' Olmo2RMSNorm (Llama's casts first).
        q_out = (q_norm.weight * (qf * torch.rsqrt(q_var + q_norm.eps))).to(q.dtype)
        k_out = (k_norm.weight * (kf * torch.rsqrt(k_var + k_norm.eps))).to(k.dtype)
        return q_out.view(q.shape), k_out.view(k.shape)
