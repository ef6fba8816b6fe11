"""Rotary position embeddings: default, linear and llama3 frequency scaling.

cos/sin are computed exactly as transformers does (fp32 outer product, then cast), so
greedy outputs can be token-identical in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    # Explicit cpu device: the model may be constructed under a meta-device context.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3: leave high frequencies, divide low ones by `factor`, blend in between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position.

    A plain object, not a module: the model is built on the meta device and
    materialised by the loader, but these tables are computed, never loaded.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, device: torch.device | str) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float, device="cpu")[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device)  # [max_positions, head_dim] fp32
        self.sin = emb.sin().to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions [T] int64, each [T, 1, D]: looked up once per step."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


@dataclass
class RotaryTables:
    """What a fused rotary op takes instead of looked-up cos/sin: it reads the fp32
    tables at each token's position itself (engine/model/fused_ops.py)."""

    cos: torch.Tensor  # [max_positions, head_dim] fp32
    sin: torch.Tensor
    positions: torch.Tensor  # [T] int64
    rotate_: Callable[..., None]  # (q, k, cos, sin, positions), in place


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D]; k: [T, Hkv, D]; cos, sin from RotaryEmbedding.lookup."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
