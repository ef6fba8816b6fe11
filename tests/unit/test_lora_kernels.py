"""The LoRA SGMV Triton kernels (engine/kernels/lora_sgmv.py) against LoRALinear's torch
path, under TRITON_INTERPRET=1 on CPU (tests/conftest.py turns it on): decode-like rows
of several slots interleaved, a long prompt's run of one slot spanning tiles, rows
without an adapter (their output untouched), a rank and widths that are no multiple of
the tiles, and a slot no row uses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kernels.lora_sgmv import BLOCK_M, lora_sgmv, lora_sgmv_reference, tiles_by_slot

# bfloat16: two roundings (the shrink's z, the delta) of values up to ~8, where one ulp
# is 0.03-0.06, and the interpreter truncates float32 -> bfloat16 instead of rounding.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=8e-2, rtol=3e-2)}


def case(slot_of_row: list[int], dtype: torch.dtype, width: int = 72, out: int = 99, rank: int = 40,
         slots: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(slot_of_row), width, generator=g).to(dtype)
    y = torch.randn(len(slot_of_row), out, generator=g).to(dtype)
    a = (torch.randn(slots, rank, width, generator=g) * 0.3).to(dtype)
    b = (torch.randn(slots, out, rank, generator=g) * 0.3).to(dtype)
    return x, y, a, b, np.array(slot_of_row)


SCHEDULES = {
    "decode": [0, 2, -1, 1, 0, 2, 2, -1, 1, 0, 3],
    "prefill beside decode": [1] * 37 + [0, -1, 2, 0],
    "no adapter": [-1, -1, -1],
    "one row": [2],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_sgmv_equals_the_torch_path(schedule: str, dtype: torch.dtype) -> None:
    x, y, a, b, slot_of_row = case(SCHEDULES[schedule], dtype)
    rows, tile_slot = tiles_by_slot(slot_of_row)
    want = lora_sgmv_reference(x, y, a, b, torch.from_numpy(slot_of_row))
    got = lora_sgmv(x, y.clone(), a, b, torch.from_numpy(rows), torch.from_numpy(tile_slot))
    torch.testing.assert_close(got, want, **TOL[dtype])
    untouched = slot_of_row < 0
    assert torch.equal(got[torch.from_numpy(untouched)], y[torch.from_numpy(untouched)])


def test_tiles_pad_each_slots_run_with_the_sentinel() -> None:
    rows, tile_slot = tiles_by_slot(np.array([1, 0, 1, -1] + [1] * 16))
    assert list(tile_slot) == [0, 1, 1] and len(rows) == 3 * BLOCK_M
    assert list(rows[:BLOCK_M]) == [1] + [20] * (BLOCK_M - 1)
    assert sorted(r for r in rows[BLOCK_M:] if r < 20) == [0, 2, *range(4, 20)]
    assert tiles_by_slot(np.array([-1, -1]))[1].shape == (0,)


def test_bad_inputs_are_named() -> None:
    x, y, a, b, slot_of_row = case([0, 1], torch.float32)
    rows, tile_slot = (torch.from_numpy(t) for t in tiles_by_slot(slot_of_row))
    with pytest.raises(ValueError, match="must be \\[S, R, 72\\] and \\[S, 99, R\\]"):
        lora_sgmv(x, y, a[:, :, :8], b, rows, tile_slot)
    with pytest.raises(ValueError, match="share one of"):
        lora_sgmv(x, y, a.double(), b, rows, tile_slot)
    with pytest.raises(ValueError, match="rows per tile"):
        lora_sgmv(x, y, a, b, rows[:3], tile_slot)
