"""Projections that add their LoRA adapters' deltas, each row by its own adapter.

Every adapted projection (qkv_proj, o_proj, gate_up_proj, down_proj of each decoder
layer) is wrapped in a LoRALinear holding one A and one B per adapter slot:

    A [slots, R, in]    B [slots, out, R]    (R = max_lora_rank x the projections it fuses)

A slot with no adapter, or a projection its adapter leaves alone, holds zeros. One
step's rows name their slot (-1: the base model) in a LoRAStep, grouped on the host
once and made visible for the forward pass like the attention metadata. Each layer
then adds (x[rows] @ A[slot].T) @ B[slot].T to the base output of each slot's rows:
batched over the slots, padded to the same rows (BGMV's shape), or slot by slot
(SGMV's) where padding would more than double the work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from engine.lora.adapter import LoRAAdapter, max_parts, part_sizes
from engine.model.config import ModelConfig


@dataclass
class LoRAStep:
    """One step's rows by adapter slot, grouped on the host once for every layer.

    Balanced (decode: a row or a few per request): slots [0, S) padded to M rows each,
    `gather` [S * M] the row in each place (0 where none, masked out by `mask`), so a
    projection runs one gather, two batched matmuls over the slots and one scatter,
    whatever the mix. Unbalanced (a long prompt beside decode rows), where padding
    would multiply the work: `groups`, (slot, its rows) each, a shrink and expand per slot."""

    slots: int
    rows: int = 0
    gather: torch.Tensor | None = None  # [S * M] int64
    mask: torch.Tensor | None = None  # [S * M, 1] float32 (an in-place multiply casts it)
    groups: list[tuple[int, torch.Tensor]] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, slot_of_row: np.ndarray, device: torch.device) -> LoRAStep | None:
        """slot_of_row [T] (-1: no adapter); None when no row has one."""
        slots = int(slot_of_row.max(initial=-1)) + 1
        if slots == 0:
            return None
        rows_of = [np.flatnonzero(slot_of_row == s) for s in range(slots)]
        m = max(len(r) for r in rows_of)
        if slots * m > 2 * len(slot_of_row) + 16:
            return cls(slots, groups=[(s, torch.from_numpy(r).to(device)) for s, r in enumerate(rows_of) if len(r)])
        gather, mask = np.zeros((slots, m), dtype=np.int64), np.zeros((slots, m, 1), dtype=np.float32)
        for s, r in enumerate(rows_of):
            gather[s, :len(r)], mask[s, :len(r)] = r, 1.0
        return cls(slots, m, torch.from_numpy(gather.reshape(-1)).to(device),
                   torch.from_numpy(mask.reshape(-1, 1)).to(device))


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
        if step is None:
            return y
        if step.gather is not None and step.mask is not None:
            s, m = step.slots, step.rows
            xs = x.index_select(0, step.gather).view(s, m, -1)
            delta = torch.bmm(torch.bmm(xs, self.lora_a[:s].transpose(1, 2)), self.lora_b[:s].transpose(1, 2))
            return y.index_add_(0, step.gather, delta.view(s * m, -1).mul_(step.mask))
        for slot, rows in step.groups:
            delta = (x.index_select(0, rows) @ self.lora_a[slot].T) @ self.lora_b[slot].T
            y = y.index_add_(0, rows, delta)
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
