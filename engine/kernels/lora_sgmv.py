"""LoRA's shrink and expand as two grouped GEMMs over a step's rows sorted by adapter
slot (SGMV, Punica's shape): the GPU counterpart of LoRALinear's torch path
(engine/lora/layers.py).

1. tiles_by_slot (host, once per step: LoRAStep): the rows that have an adapter, sorted
   by slot, each slot's run padded to a whole number of BLOCK_M rows with the sentinel
   T, and the slot of each BLOCK_M tile. Decode rows of one adapter share tiles, so an
   adapter's A and B are read once per tile, not once per row; a long prompt's rows
   fill many tiles of one slot.
2. _shrink_kernel: per (tile, rank block), z[tile rows] = x[rows] @ A[slot].T (fp32
   accumulate, tiled over the input width), stored in x's dtype (torch rounds x @ A.T so).
3. _expand_kernel: per (tile, output block), y[rows] += z[tile rows] @ B[slot].T, the
   delta rounded to y's dtype before it is added (as torch's index_add_ of a delta).

Each row is in one tile at most, so the expand's read-modify-write of y needs no
atomics. Rows without an adapter are in no tile and keep the base output.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from engine.kernels.common import SUPPORTED_DTYPES, dot_precision

BLOCK_M = 16  # rows per tile (tl.dot needs >= 16)
BLOCK_K = 32  # the shrink's reduction step over the input width
BLOCK_R = 16  # rank columns per shrink program, and the expand's reduction step
BLOCK_N = 64  # output columns per expand program


def tiles_by_slot(slot_of_row: np.ndarray, block_m: int = BLOCK_M) -> tuple[np.ndarray, np.ndarray]:
    """(rows sorted by slot, each slot's run padded to a multiple of block_m with the
    sentinel len(slot_of_row); the slot of each block_m tile). slot_of_row [T], -1: none."""
    t = len(slot_of_row)
    runs, slots = [], []
    for slot in range(int(slot_of_row.max(initial=-1)) + 1):
        rows = np.flatnonzero(slot_of_row == slot)
        if not len(rows):
            continue
        tiles = -(-len(rows) // block_m)
        runs.append(np.concatenate([rows, np.full(tiles * block_m - len(rows), t)]))
        slots += [slot] * tiles
    if not runs:
        return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32)
    return np.concatenate(runs).astype(np.int32), np.array(slots, dtype=np.int32)


@triton.jit
def _tile(rows_ptr, tile_slot_ptr, num_rows, BLOCK_M: tl.constexpr):
    """This program's tile: its slot, its places in the sorted rows, the rows there, and
    which are rows (padding holds the sentinel num_rows)."""
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    place = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(rows_ptr + place)
    return slot, place, rows, rows < num_rows


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, z_ptr, rows_ptr, tile_slot_ptr, num_rows, width, rank,
                   stride_x, stride_as, stride_ar, stride_z,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    slot, place, rows, row_ok = _tile(rows_ptr, tile_slot_ptr, num_rows, BLOCK_M)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rank
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, width, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < width
        xs = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_as + r[None, :] * stride_ar + k[:, None],
                    mask=k_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(xs, a, acc=acc, input_precision=PRECISION)
    tl.store(z_ptr + place[:, None].to(tl.int64) * stride_z + r[None, :], acc.to(z_ptr.dtype.element_ty),
             mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(z_ptr, b_ptr, y_ptr, rows_ptr, tile_slot_ptr, num_rows, out_features, rank,
                   stride_z, stride_bs, stride_bn, stride_y,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    slot, place, rows, row_ok = _tile(rows_ptr, tile_slot_ptr, num_rows, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < out_features
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < rank
        # Padding places were never written: masked, never read.
        z = tl.load(z_ptr + place[:, None].to(tl.int64) * stride_z + r[None, :],
                    mask=row_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
        b = tl.load(b_ptr + slot * stride_bs + n[None, :] * stride_bn + r[:, None],
                    mask=r_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(z, b, acc=acc, input_precision=PRECISION)
    dtype = y_ptr.dtype.element_ty
    where = y_ptr + rows[:, None].to(tl.int64) * stride_y + n[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    y = tl.load(where, mask=mask, other=0.0).to(tl.float32)
    tl.store(where, (y + acc.to(dtype).to(tl.float32)).to(dtype), mask=mask)


def lora_sgmv(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, rows: torch.Tensor,
              tile_slot: torch.Tensor) -> torch.Tensor:
    """y[t] += (x[t] @ A[s].T) @ B[s].T for each row t in a tile of slot s (tiles_by_slot's
    rows and tile_slot, on x's device); y in place, returned.

    x [T, in]; y [T, out]; lora_a [S, R, in]; lora_b [S, out, R]: all one dtype, last
    dimensions contiguous."""
    _check(x, y, lora_a, lora_b, rows, tile_slot)
    num_tiles = tile_slot.shape[0]
    if num_tiles == 0:
        return y
    rank, out_features = lora_a.shape[1], lora_b.shape[1]
    z = torch.empty((rows.shape[0], rank), dtype=x.dtype, device=x.device)
    precision = dot_precision(x.dtype)
    _shrink_kernel[(num_tiles, triton.cdiv(rank, BLOCK_R))](
        x, lora_a, z, rows, tile_slot, x.shape[0], x.shape[1], rank, x.stride(0), lora_a.stride(0),
        lora_a.stride(1), z.stride(0), BLOCK_M=BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, PRECISION=precision)
    _expand_kernel[(num_tiles, triton.cdiv(out_features, BLOCK_N))](
        z, lora_b, y, rows, tile_slot, x.shape[0], out_features, rank, z.stride(0), lora_b.stride(0),
        lora_b.stride(1), y.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, PRECISION=precision)
    return y


def lora_sgmv_reference(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                        slot_of_row: torch.Tensor) -> torch.Tensor:
    """The oracle: LoRALinear's torch path, slot by slot, on a copy of y."""
    out = y.clone()
    for slot in range(int(slot_of_row.max().item()) + 1 if len(slot_of_row) else 0):
        rows = torch.nonzero(slot_of_row == slot).flatten()
        if len(rows):
            out.index_add_(0, rows, (x.index_select(0, rows) @ lora_a[slot].T) @ lora_b[slot].T)
    return out


def _check(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, rows: torch.Tensor,
           tile_slot: torch.Tensor) -> None:
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must be [T, in] and [T, out], got {tuple(x.shape)} and {tuple(y.shape)}")
    if lora_a.dim() != 3 or lora_b.dim() != 3 or lora_a.shape[2] != x.shape[1] or lora_b.shape[1] != y.shape[1] \
            or lora_b.shape[2] != lora_a.shape[1] or lora_a.shape[0] != lora_b.shape[0]:
        raise ValueError(f"lora_a {tuple(lora_a.shape)} and lora_b {tuple(lora_b.shape)} must be [S, R, "
                         f"{x.shape[1]}] and [S, {y.shape[1]}, R]")
    if x.dtype not in SUPPORTED_DTYPES or len({x.dtype, y.dtype, lora_a.dtype, lora_b.dtype}) != 1:
        raise ValueError(f"x, y, lora_a, lora_b must share one of {SUPPORTED_DTYPES}, got "
                         f"{x.dtype}, {y.dtype}, {lora_a.dtype}, {lora_b.dtype}")
    if any(t.stride(-1) != 1 for t in (x, y, lora_a, lora_b)):
        raise ValueError("x, y, lora_a and lora_b need contiguous last dimensions")
    if rows.dtype != torch.int32 or tile_slot.dtype != torch.int32 or rows.shape[0] != tile_slot.shape[0] * BLOCK_M:
        raise ValueError(f"rows and tile_slot must be int32, {BLOCK_M} rows per tile (tiles_by_slot), got "
                         f"{rows.shape[0]} rows for {tile_slot.shape[0]} tiles")
    if len({x.device, y.device, lora_a.device, lora_b.device, rows.device, tile_slot.device}) != 1:
        raise ValueError("x, y, the adapters and the tiles must be on one device")
