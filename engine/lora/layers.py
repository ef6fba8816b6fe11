"""Projections that add their LoRA adapters' deltas, each row by its own adapter.

Every adapted projection (qkv_proj, o_proj, gate_up_proj, down_proj of each decoder
layer) is wrapped in a LoRALinear holding one A and one B per adapter slot:

    A [slots, R, in]    B [slots, out, R]    (R = max_lora_rank x the projections it fuses)

A slot with no adapter, or a projection its adapter leaves alone, holds zeros. One
step's rows name their slot (-1: the base model) in a LoRAStep, grouped on the host
once and made visible for the forward pass like the attention metadata. Each layer
then adds (x[rows] @ A[slot].T) @ B[slot].T to the base output of each slot's rows:
on CUDA by two Triton grouped GEMMs over the rows sorted by slot (SGMV:
engine/kernels/lora_sgmv.py); in torch, batched over the slots, padded to the same
rows (BGMV's shape), or slot by slot where padding would more than double the work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from engine.distributed.sharding import Shard
from engine.lora.files import max_parts, part_sizes
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
    # On CUDA: the rows sorted by slot in tiles, and each tile's slot, for the Triton
    # SGMV kernels (engine/kernels/lora_sgmv.py), which replace both torch paths.
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def of(cls, slot_of_row: np.ndarray, device: torch.device) -> LoRAStep | None:
        """slot_of_row [T] (-1: no adapter); None when no row has one."""
        slots = int(slot_of_row.max(initial=-1)) + 1
        if slots == 0:
            return None
        if use_sgmv(device):
            from engine.kernels.lora_sgmv import tiles_by_slot

            rows, tile_slot = tiles_by_slot(slot_of_row)
            return cls(slots, tiles=(torch.from_numpy(rows).to(device), torch.from_numpy(tile_slot).to(device)))
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


def use_sgmv(device: torch.device) -> bool:
    """Whether steps on `device` run the Triton kernels (a test turns them on on CPU,
    under the interpreter)."""
    return device.type == "cuda"


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

    def __init__(self, base: nn.Module, columns: torch.Tensor, rows: torch.Tensor, slots: int, rank: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        """`columns`, `rows`: the unsharded projection's input columns and output rows this
        rank holds (all of them at tensor_parallel_size 1), in its own order."""
        super().__init__()
        self.base = base
        self.columns, self.rows, self.rank = columns, rows, rank
        self.register_buffer("lora_a", torch.zeros(slots, rank, len(columns), dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(slots, len(rows), rank, dtype=dtype, device=device),
                             persistent=False)

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put an adapter's A [r, in] and B [out, r] of the unsharded projection in
        `slot`, sliced as the base projection is on this rank (None, None: empty it).
        A column-parallel projection (qkv, gate_up) keeps A whole and its rows of B;
        a row-parallel one (o, down) its columns of A and B whole: its delta is a
        partial sum, all-reduced with the base output (engine/model/llama.py)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if a is not None and b is not None:
            r = a.shape[0]
            self.lora_a[slot, :r] = a[:, self.columns].to(self.lora_a.dtype)
            self.lora_b[slot, :, :r] = b[self.rows].to(self.lora_b.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = _current
        if step is None:
            return y
        if step.tiles is not None:
            from engine.kernels.lora_sgmv import lora_sgmv

            return lora_sgmv(x, y, self.lora_a, self.lora_b, *step.tiles)
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
                     device: torch.device | str, shard: Shard | None = None) -> dict[tuple[int, str], LoRALinear]:
    """Wrap every decoder layer's adapted projections in a LoRALinear of `slots` empty
    slots, sized as this rank's `shard` of them (None: whole); returns them by (layer, module)."""
    wrapped = {}
    layers = cast("nn.ModuleList", model.layers)
    for index, layer in enumerate(layers):
        owners: list[tuple[Any, str]] = [(layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                         (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")]
        for owner, module in owners:
            columns, rows = held(cfg, module, shard)
            lora = LoRALinear(getattr(owner, module), columns, rows, slots, max_rank * max_parts(module), dtype,
                              device)
            setattr(owner, module, lora)
            wrapped[(index, module)] = lora
    return wrapped


def held(cfg: ModelConfig, module: str, shard: Shard | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input columns, output rows) of the unsharded projection that `shard` holds, in
    the order its base projection holds them (engine/distributed/sharding.py): qkv_proj
    its query heads' rows, then its KV heads' of k, then of v; gate_up_proj its
    intermediate range of gate, then of up; o_proj and down_proj their inputs' range."""
    sizes, width = part_sizes(cfg, module)
    every = torch.arange

    def span(start: int, lo: int, hi: int, unit: int) -> torch.Tensor:
        return every(start + lo * unit, start + hi * unit)

    if shard is None or shard.size == 1:
        return every(width), every(sum(sizes))
    hd, inter = cfg.head_dim, shard.intermediate
    if module == "qkv_proj":
        q, kv = sizes[0], sizes[1]
        return every(width), torch.cat([span(0, *shard.q_heads, hd), span(q, *shard.kv_heads, hd),
                                        span(q + kv, *shard.kv_heads, hd)])
    if module == "gate_up_proj":
        return every(width), torch.cat([span(0, *inter, 1), span(sizes[0], *inter, 1)])
    if module == "o_proj":
        return span(0, *shard.q_heads, hd), every(sum(sizes))
    return span(0, *inter, 1), every(sum(sizes))  # down_proj


def load_into_slot(wrapped: dict[tuple[int, str], LoRALinear], slot: int,
                   weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every wrapped projection's `slot` takes an adapter's A and B, unsharded
    (LoRAAdapter.weights: zeros where it has none; {}: empty the slot)."""
    for key, lora in wrapped.items():
        lora.set_slot(slot, *weights.get(key, (None, None)))
