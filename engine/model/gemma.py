"""Gemma 2/3's pieces of the one Llama-family model (model/llama.py), where its
arithmetic differs from Llama's: RMSNorms that scale by (1 + weight) in float32 (before
the cast back, unlike Llama's), the GeGLU activation, the embeddings' sqrt(hidden)
scale, and tanh soft-capping. Their layout (a norm before and after each sublayer,
ModelConfig.norm_placement "sandwich"), per-layer windows and Gemma 3's two RoPE bases
are the model's; the parameters read from ModelConfig.gemma (model/config.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.norm import RMSNorm


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), all in float32, then cast (transformers' Gemma2RMSNorm;
    checkpoints store weight - 1, so the weight starts at 0, not 1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU: gelu(gate) * up with the tanh approximation (gelu_pytorch_tanh)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def scale_embeddings(x: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """Embeddings times sqrt(hidden_size), the factor rounded to x's dtype first, as
    transformers does."""
    return x * torch.tensor(hidden_size ** 0.5, dtype=x.dtype)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), in transformers' order of operations (final logits)."""
    return torch.tanh(x / cap) * cap
