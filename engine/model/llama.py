"""The Llama family as one model: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm),
OLMo 2 (norms after each sublayer, q/k norms over whole projections: olmo2.py), Phi-3
(fused checkpoint tensors, partial rotary), Gemma 2/3 (norms before and after each
sublayer, and gemma.py's arithmetic; each layer's sliding window and, for Gemma 3, its
RoPE base), their mixtures of experts, Mixtral,
Qwen2-MoE and Qwen3-MoE (a sparse MLP: moe.py), and DeepSeek-V2/V3 (multi-head latent
attention, mla.py, and a sparse MLP after the first first_k_dense_replace layers).

Works on a flattened batch: input_ids and positions are [T] for all new tokens of all
sequences in the step; attention finds its sequences through the attention context.
q/k/v and gate/up are fused into one matmul each (fewer, larger GEMMs); the loader
splits checkpoint tensors into them.

Tensor parallel (engine/distributed): each rank builds the model for its Shard. qkv
and gate_up are column-parallel (the rank's heads, its slice of the intermediate
dimension), o and down row-parallel with one all-reduce each, the embedding
vocab-parallel (an all-reduce), and lm_head holds the rank's vocabulary rows, its
logits gathered on rank 0, where sampling happens. With one rank every collective is
the identity.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.kv_quant import is_fp8, round_to_cache
from engine.attention.metadata import current_metadata
from engine.distributed.group import SINGLE, Group
from engine.distributed.sharding import Shard
from engine.kv_cache.layout import layer_view
from engine.model.config import ModelConfig
from engine.model.fused_ops import FusedOps, fused_ops
from engine.model.gemma import GemmaRMSNorm, gelu_tanh_mul, scale_embeddings, softcap
from engine.model.mla import MLAttention
from engine.model.moe import GatedMLP, SparseMoE, silu_mul
from engine.model.norm import RMSNorm
from engine.model.olmo2 import ProjectionQKNorm
from engine.model.rope import RotaryEmbedding, RotaryTables, apply_rotary


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, shard: Shard, group: Group,
                 window: int = 0) -> None:
        super().__init__()
        self.window = window  # > 0: a sliding-window layer, attending over its last `window` positions
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_q_heads, shard.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.group = group
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        # q/k norms: over each head (Qwen3), or over the rank's part of the whole
        # projections (OLMo 2), applied by projection_norm, which sums over the ranks.
        self.projection_norm = ProjectionQKNorm(cfg, shard, group) if cfg.qk_norm == "projection" else None
        q_width, k_width = (self.q_size, self.kv_size) if self.projection_norm else (cfg.head_dim, cfg.head_dim)
        norm = GemmaRMSNorm if cfg.gemma else RMSNorm
        self.q_norm = norm(q_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = norm(k_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = backend
        self.scale = cfg.gemma.query_scale if cfg.gemma else cfg.head_dim ** -0.5
        self.softcap = cfg.gemma.attn_softcap if cfg.gemma else 0.0  # Gemma 2's scores
        self.layer_cache: torch.Tensor | None = None  # [num_blocks, 2, bs, Hkv, D] view, bound by the runner
        # An fp8 cache holds K / k_scale and V / v_scale (attention/kv_quant.py): the
        # checkpoint's, else 1.0.
        self.k_scale, self.v_scale = 1.0, 1.0

    def forward(self, rotary: tuple[torch.Tensor, torch.Tensor] | RotaryTables, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (cfg.qk_norm)
            if self.projection_norm is not None:
                q, k = self.projection_norm(q, k, self.q_norm, self.k_norm)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
        if isinstance(rotary, RotaryTables):
            rotary.apply_(q, k)  # in place (in the qkv buffer, without q/k norms)
        else:
            q, k = apply_rotary(q, k, *rotary)
        md = current_metadata()
        assert self.layer_cache is not None, "KV cache not bound to the model"
        cache, scale = self.layer_cache, self.scale
        if is_fp8(cache.dtype):  # computes with what the cache holds, cached or fresh
            k, v = round_to_cache(k, self.k_scale, cache.dtype), round_to_cache(v, self.v_scale, cache.dtype)
            scale *= self.k_scale
        self.backend.store_kv(cache, k, v, md)
        o = self.backend.attention(q, k, v, cache, md, scale, self.window, self.softcap)
        if is_fp8(cache.dtype) and self.v_scale != 1.0:
            o = o * self.v_scale
        return self.group.all_reduce_(self.o_proj(o.reshape(t, self.q_size)))


class MLP(GatedMLP):
    """The rank's slice of the dense MLP's intermediate dimension, summed over the ranks."""

    def __init__(self, cfg: ModelConfig, shard: Shard, group: Group) -> None:
        super().__init__(cfg.hidden_size, shard.intermediate_size)
        self.group = group
        self.act = gelu_tanh_mul if cfg.gemma else silu_mul

    def forward(self, x: torch.Tensor,
                silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        return self.group.all_reduce_(super().forward(x, silu_and_mul or self.act))


def embedding(rows: int, dim: int) -> nn.Embedding:
    """An embedding left uninitialised (loading fills it). Given a weight, nn.Embedding
    skips its normal_ init, which even on the meta device imports torch._dynamo: about
    1.5 s of CPU in each process that builds a model (a TP follower, a worker)."""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


class VocabParallelEmbedding(nn.Embedding):
    """The rank's rows [vocab start, end) of the embedding: a token outside them
    contributes zeros, and the all-reduce sums in the one rank that holds it."""

    def __init__(self, shard: Shard, hidden_size: int, group: Group) -> None:
        # uninitialised, as embedding() says why
        super().__init__(shard.vocab_rows, hidden_size, _weight=torch.empty(shard.vocab_rows, hidden_size))
        self.start, self.group = shard.vocab[0], group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce_(x.masked_fill_(outside.unsqueeze(-1), 0))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, shard: Shard, group: Group,
                 index: int = 0) -> None:
        super().__init__()
        # "post" (OLMo 2): no input norm; post_attention_layernorm and
        # post_feedforward_layernorm normalise the sublayers' outputs before their adds.
        # "sandwich" (Gemma 2/3): those, and input_layernorm and pre_feedforward_layernorm
        # before the sublayers too.
        self.placement = cfg.norm_placement
        norm = GemmaRMSNorm if cfg.gemma else RMSNorm
        if self.placement != "post":
            self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn: Attention | MLAttention = (MLAttention(cfg, backend, shard, group) if cfg.mla else
                                                   Attention(cfg, backend, shard, group, cfg.layer_window(index)))
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.placement != "pre":
            self.post_feedforward_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.placement == "sandwich":
            self.pre_feedforward_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        # Gemma 3's sliding layers turn q and k by their own RoPE base (the model's local tables).
        self.local_rope = cfg.gemma is not None and index in cfg.gemma.local_layers
        sparse = cfg.moe is not None and index in cfg.moe.sparse_layers
        self.mlp: MLP | SparseMoE = SparseMoE(cfg, shard, group) if sparse else MLP(cfg, shard, group)

    def forward(self, rotary: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if self.placement == "post":
            x = x + self.post_attention_layernorm(self.self_attn(rotary, x))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        if self.placement == "sandwich":
            x = x + self.post_attention_layernorm(self.self_attn(rotary, self.input_layernorm(x)))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(rotary, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, ops: FusedOps, rotary: RotaryTables, x: torch.Tensor,
                      residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer with each residual add fused into the next norm: takes and
        returns (this sublayer's output, the residual stream before it is added)."""
        if self.placement == "post":
            return self._forward_fused_post_norms(ops, rotary, x, residual)
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        h, residual = ops.add_rms_norm(x, norm1.weight, norm1.eps, residual)
        h = self.self_attn(rotary, h)
        h, residual = ops.add_rms_norm(h, norm2.weight, norm2.eps, residual)
        return self.mlp(h, ops.silu_and_mul), residual

    def _forward_fused_post_norms(self, ops: FusedOps, rotary: RotaryTables, x: torch.Tensor,
                                  residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """forward_fused for norms after the sublayers: a norm takes a sublayer's output,
        not the stream, so no add fuses into it; the deferred add is made here first, and
        the MLP's normalised output goes back with the stream for the next one to add."""
        norm1, norm2 = self.post_attention_layernorm, self.post_feedforward_layernorm
        stream = x if residual is None else x + residual
        h, _ = ops.add_rms_norm(self.self_attn(rotary, stream), norm1.weight, norm1.eps)
        stream = stream + h
        h, _ = ops.add_rms_norm(self.mlp(stream, ops.silu_and_mul), norm2.weight, norm2.eps)
        return h, stream


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int,
                 device: torch.device | str, shard: Shard | None = None, group: Group = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.shard = shard = shard or Shard.of(cfg)
        self.group = group
        rope_dim = cfg.mla.qk_rope_head_dim if cfg.mla else cfg.rotary_dim
        self.rope = RotaryEmbedding(rope_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device)
        local_theta = cfg.gemma.local_rope_theta if cfg.gemma else None
        self.local_rope = None if local_theta is None else RotaryEmbedding(rope_dim, max_positions, local_theta,
                                                                           None, device)
        if shard.size == 1:
            self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(shard, cfg.hidden_size, group)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, shard, group, i) for i in range(cfg.num_layers))
        self.norm = (GemmaRMSNorm if cfg.gemma else RMSNorm)(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, shard.vocab_rows, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Called with a layer's index once its forward (its KV written) is queued: the
        # engine's layer hook (EngineCore.set_layer_hook), for a step at a time.
        self.layer_hook: Callable[[int], None] | None = None

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """kv_cache: [num_blocks, Hkv, num_layers, planes, block_size, D]; each layer keeps its
        strided view [num_blocks, 2, block_size, Hkv, D] (engine/kv_cache/layout.py)."""
        for i, layer in enumerate(self._decoder_layers()):
            layer.self_attn.layer_cache = layer_view(kv_cache, i)

    def kv_scales(self) -> tuple[tuple[float, float], ...]:
        """Per layer, (k_scale, v_scale): what an fp8 cache's values are multiplied by
        when read (MLA's latent: its one scale, twice)."""
        scales = []
        for layer in self._decoder_layers():
            attn = layer.self_attn
            scales.append((attn.k_scale, attn.v_scale if isinstance(attn, Attention) else attn.k_scale))
        return tuple(scales)

    def _decoder_layers(self) -> list[DecoderLayer]:
        return cast("list[DecoderLayer]", self.layers)  # cast: a ModuleList is typed as holding any Module

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                logits_indices: torch.Tensor) -> torch.Tensor | None:
        """input_ids, positions: [T] int64; logits_indices: [S] int64 rows to project.

        Returns logits [S, vocab] float32 (only the rows that are sampled); None on the
        ranks of a TP group but the first (they are gathered there).
        """
        x = self.embed_tokens(input_ids)
        if self.config.gemma:
            x = scale_embeddings(x, self.config.hidden_size)
        # The fused layer ops for these activations, or None: torch's (always for Gemma,
        # whose norms and activation the fused ops do not compute).
        ops = fused_ops(x) if self.config.gemma is None else None
        if ops is not None:
            tables = RotaryTables(self.rope.cos, self.rope.sin, positions, ops.rotary_)
            residual: torch.Tensor | None = None
            for i, layer in enumerate(self._decoder_layers()):
                x, residual = layer.forward_fused(ops, tables, x, residual)
                if self.layer_hook is not None:
                    self.layer_hook(i)
            assert residual is not None  # set by the first layer: a model has at least one
            x, _ = ops.add_rms_norm(x[logits_indices], self.norm.weight, self.norm.eps, residual[logits_indices])
            return self._logits(x)
        rotary = self.rope.lookup(positions, torch.float32 if self.config.mla and self.config.mla.rope_fp32
                                  else x.dtype)
        local = rotary if self.local_rope is None else self.local_rope.lookup(positions, x.dtype)
        for i, layer in enumerate(self._decoder_layers()):
            x = layer(local if layer.local_rope else rotary, x)
            if self.layer_hook is not None:
                self.layer_hook(i)
        return self._logits(self.norm(x[logits_indices]))

    def _logits(self, x: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(x).float()
        if self.shard.size > 1:
            gathered = self.group.gather_last_dim(logits)
            if gathered is None:
                return None
            logits = gathered[:, :self.config.vocab_size]
        cap = self.config.gemma.final_softcap if self.config.gemma else 0.0
        return softcap(logits, cap) if cap else logits
