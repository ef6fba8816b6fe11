"""A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) read into the
engine's module layout: per decoder layer and projection the engine runs (q, k and v
fused into qkv_proj, gate and up into gate_up_proj), one A [R, in] and one B [out, R]
whose product, scaled, is what PEFT adds to that projection's weight.

A fused projection's A stacks its parts' A rows (each part's rank), and its B places
each part's scaled B at that part's output rows and rank columns, zero elsewhere: one
shrink and one expand then compute every part's delta at once. What PEFT would add and
pdserve cannot is refused by name (DoRA, biases, modules_to_save, embeddings, experts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.lora.files import (
    PARTS,
    WEIGHTS_FILE,
    cache_root,
    check_declared,
    check_tensors,
    part_sizes,
    pattern_value,
    read_files,
)
from engine.model.config import ModelConfig


@dataclass(eq=False)
class LoRAAdapter:
    """One read of an adapter's files (the same name read again, from another directory
    or changed files, is another LoRAAdapter)."""

    name: str
    path: str
    rank: int  # the largest rank of any of its projections
    # (layer, module) -> (A [R, in], B [out, R]), float32, B already scaled.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: int = 0  # of its files' bytes

    @property
    def cache_root(self) -> int:
        """The parent hash of a prompt's first KV block under this adapter: its blocks'
        hashes chain from it, so no other adapter, no other read of these files, nor
        the base model ever hits them."""
        return cache_root(self.name, self.digest)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def load_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT adapter directory for the model `cfg`; ValueError naming
    what does not fit (missing files, a rank above max_rank, unsupported options,
    tensors whose shapes are not this model's)."""
    from safetensors.torch import load

    config, raw_weights, digest = read_files(name, path)
    try:
        tensors = load(raw_weights)
    except Exception as exc:  # safetensors' own error types: a truncated or foreign file
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} cannot be read: {exc}") from None
    shapes = {key: tuple(t.shape) for key, t in tensors.items()}
    pairs = check_tensors(name, shapes, cfg, max_rank)
    check_declared(name, config, {at: shapes[key_a][0] for at, (key_a, _) in pairs.items()})
    parts: dict[tuple[int, str], dict[int | None, tuple[torch.Tensor, torch.Tensor, float]]] = {}
    for (layer, proj), (key_a, key_b) in pairs.items():
        a, b = tensors[key_a].float(), tensors[key_b].float()
        module, part = PARTS[proj]
        parts.setdefault((layer, module), {})[part] = (a, b, _scaling(config, proj, layer, a.shape[0]))
    weights = {key: _fuse(cfg, key[1], by_part) for key, by_part in parts.items()}
    return LoRAAdapter(name, str(path), max(a.shape[0] for a, _ in weights.values()), weights, digest)


def _fuse(cfg: ModelConfig, module: str,
          by_part: dict[int | None, tuple[torch.Tensor, torch.Tensor, float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One module's A [R, in] and scaled B [out, R] from its parts' (A, B, scaling)."""
    if None in by_part:  # check_tensors refused it beside its parts
        a, b, scale = by_part[None]
        return a, b * scale
    sizes, width = part_sizes(cfg, module)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    rank = sum(a.shape[0] for a, _, _ in by_part.values())
    big_a, big_b = torch.zeros(rank, width), torch.zeros(sum(sizes), rank)
    at = 0
    for part, (a, b, scale) in sorted(by_part.items(), key=lambda kv: kv[0] or 0):
        assert part is not None
        r = a.shape[0]
        big_a[at:at + r] = a
        big_b[offsets[part]:offsets[part] + sizes[part], at:at + r] = b * scale
        at += r
    return big_a, big_b


def _scaling(config: dict[str, Any], proj: str, layer: int, rank: int) -> float:
    """PEFT's scaling: lora_alpha / r, or / sqrt(r) with rsLoRA; per-module alphas from
    alpha_pattern. The rank is the tensors' (rank_pattern's, when it set one)."""
    alpha = pattern_value(config.get("alpha_pattern"), proj, layer)
    alpha = config["lora_alpha"] if alpha is None else alpha
    return float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)
