"""Projections that add their LoRA adapters' deltas, each row by its own adapter.

Every adapted projection (qkv_proj, o_proj, gate_up_proj, down_proj of each decoder
layer) is wrapped in a LoRALinear holding one A and one B per adapter slot:

    A [slots, R, in]    B [slots, out, R]    (R = max_lora_rank x the projections it fuses)

A slot with no adapter, or a projection its adapter leaves alone, holds zeros. One
step's rows name their slot (-1: the base model) in a LoRAStep made visible for the
forward pass, like the attention metadata. Each layer then adds, per slot present in
the step, (x[rows] @ A[slot].T) @ B[slot].T to the base output of those rows: one
shrink and one expand per slot (the SGMV shape), whatever the batch's mix.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from engine.lora.adapter import LoRAAdapter, max_parts, part_sizes
from engine.model.config import ModelConfig


@dataclass
class LoRAStep:
    """One step's rows grouped by adapter slot: (slot, the rows' indices, or None for
    every row), base-model rows left out."""

    groups: list[tuple[int, torch.Tensor | None]]

    @classmethod
    def of(cls, slot_of_row: torch.Tensor) -> LoRAStep:
        """slot_of_row [T] int64 (-1: no adapter), on the model's device."""
        slots = torch.unique(slot_of_row).tolist()
        if slots == [s for s in slots if s >= 0] and len(slots) == 1:
            return cls([(slots[0], None)])
        return cls([(s, torch.nonzero(slot_of_row == s).flatten()) for s in slots if s >= 0])


_current: LoRAStep | None = None


@contextmanager
def lora_step(step: LoRAStep | None) -> Iterator[None]:
    global _current
    _current = step
    try:
        yield
    finally:
        _current = None


class LoRALinear(nn.Module):
    """A projection plus its adapters' deltas, row by row (module docstring)."""

    lora_a: torch.Tensor  # [slots, R, in]
    lora_b: torch.Tensor  # [slots, out, R]

    def __init__(self, base: nn.Module, in_features: int, out_features: int, slots: int, rank: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.register_buffer("lora_a", torch.zeros(slots, rank, in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(slots, out_features, rank, dtype=dtype, device=device),
                             persistent=False)

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put an adapter's A [r, in] and B [out, r] in `slot` (None, None: empty it)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if a is not None and b is not None:
            r = a.shape[0]
            self.lora_a[slot, :r] = a.to(self.lora_a.dtype)
            self.lora_b[slot, :, :r] = b.to(self.lora_b.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = _current
        if step is None or not step.groups:
            return y
        for slot, rows in step.groups:
            a, b = self.lora_a[slot], self.lora_b[slot]
            if rows is None:
                y = y + (x @ a.T) @ b.T
            else:
                y = y.index_add(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
        return y


def wrap_projections(model: nn.Module, cfg: ModelConfig, slots: int, max_rank: int, dtype: torch.dtype,
                     device: torch.device | str) -> dict[tuple[int, str], LoRALinear]:
    """Wrap every decoder layer's adapted projections in a LoRALinear of `slots` empty
    slots; returns them by (layer, module)."""
    wrapped = {}
    layers = cast("nn.ModuleList", model.layers)
    for index, layer in enumerate(layers):
        owners: list[tuple[Any, str]] = [(layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                         (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")]
        for owner, module in owners:
            sizes, width = part_sizes(cfg, module)
            lora = LoRALinear(getattr(owner, module), width, sum(sizes), slots, max_rank * max_parts(module),
                              dtype, device)
            setattr(owner, module, lora)
            wrapped[(index, module)] = lora
    return wrapped


def load_into_slot(wrapped: dict[tuple[int, str], LoRALinear], slot: int, adapter: LoRAAdapter | None) -> None:
    """Every wrapped projection's `slot` takes the adapter's A and B (zeros where it has
    none; None: empty the slot)."""
    for key, lora in wrapped.items():
        ab = None if adapter is None else adapter.weights.get(key)
        lora.set_slot(slot, *(ab if ab is not None else (None, None)))
