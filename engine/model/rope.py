"""Rotary position embeddings: default, linear, llama3, yarn and longrope frequency scaling.

cos/sin are computed exactly as transformers does (fp32 outer product, then cast), so
greedy outputs can be token-identical in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                        max_positions: int) -> torch.Tensor:
    """max_positions: the engine's max_model_len (longrope picks its factors by it)."""
    # Explicit cpu device: the model may be constructed under a meta-device context.
    powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim)
    if scaling is not None and scaling["rope_type"] == "longrope":
        return 1.0 / (longrope_factors(scaling, max_positions) * powers)
    inv_freq = 1.0 / powers
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return _yarn_frequencies(inv_freq, head_dim, theta, scaling)
    # llama3: leave high frequencies, divide low ones by `factor`, blend in between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def longrope_factors(scaling: dict[str, Any], max_model_len: int) -> torch.Tensor:
    """LongRoPE's (Phi-3's) per-frequency divisors: long_factor for an engine whose
    max_model_len exceeds original_max_position_embeddings, else short_factor.

    transformers picks the set per forward pass, by that pass's max(position_ids) + 1,
    which a serving engine cannot follow: chunked prefill, prefix caching and the KV
    cache would mix keys turned with both sets. As vLLM does, the engine picks once, by
    max_model_len. Outputs equal transformers' wherever it turns a whole sequence with
    one set: every sequence on an engine of max_model_len <= original (short), and a
    prompt longer than original on a longer engine (long, from its first forward on).
    Unlike transformers, a short prompt on an engine of max_model_len > original is
    turned with the long factors (as in vLLM)."""
    factors = scaling[f"{factor_set(scaling, max_model_len)}_factor"]
    return torch.tensor(factors, dtype=torch.float32, device="cpu")


def factor_set(scaling: dict[str, Any] | None, max_model_len: int) -> str:
    """Which LongRoPE factors an engine of this max_model_len turns keys by ("long" or
    "short"; "" for the other RoPE types): KV from engines that differ here is not
    interchangeable (the P/D handshake's model name, the KV tiers' namespace)."""
    if scaling is None or scaling["rope_type"] != "longrope":
        return ""
    return "long" if max_model_len > scaling["original_max_position_embeddings"] else "short"


def _yarn_frequencies(inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: high frequencies kept, low ones divided by `factor`, a linear ramp between
    the dims that turn beta_fast and beta_slow times over the original context."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / ((high - low) or 0.001)).clamp(0, 1)
    keep = 1 - ramp
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What yarn and longrope multiply cos and sin by (1 for the other types)."""
    if scaling is None or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if scaling["rope_type"] == "longrope":  # the same for the short and long factors
        factor = scaling["factor"]
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(
            scaling["original_max_position_embeddings"]))
    factor, mscale, mscale_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    return yarn_mscale(factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position.

    A plain object, not a module: the model is built on the meta device and
    materialised by the loader, but these tables are computed, never loaded.
    max_positions is the engine's max_model_len (the loader's; longrope_factors).
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, device: torch.device | str) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling, max_positions)
        freqs = torch.arange(max_positions, dtype=torch.float, device="cpu")[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        factor = attention_factor(scaling)
        self.cos = (emb.cos() * factor).to(device)  # [max_positions, head_dim (the rotary dims)] fp32
        self.sin = (emb.sin() * factor).to(device)

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

    def apply_(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotate q [T, Hq, D] and k [T, Hkv, D] in place: the first R dims of each head
        for tables R wide (partial rotary, R < D), the rest left as they are."""
        r = self.cos.shape[1]
        self.rotate_(q[..., :r], k[..., :r], self.cos, self.sin, self.positions)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D]; k: [T, Hkv, D]; cos, sin from RotaryEmbedding.lookup, [T, 1, R]:
    the first R dims of each head turned, the rest passed through (partial rotary, as
    transformers' Phi-3 does)."""
    r = cos.shape[-1]
    if r == q.shape[-1]:
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    q_rot, k_rot = q[..., :r], k[..., :r]
    return (torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q[..., r:]), dim=-1),
            torch.cat((k_rot * cos + rotate_half(k_rot) * sin, k[..., r:]), dim=-1))
