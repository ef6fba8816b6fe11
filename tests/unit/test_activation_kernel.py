"""The fused SiLU-and-mul kernel against the model's torch ops, under the Triton
interpreter (fp32 and fp16; bf16 arithmetic is wrong in the interpreter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.activation import BLOCK, silu_and_mul

TOL = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=1e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("intermediate", [96, BLOCK + 200])  # within one block; over two, the last partial
def test_silu_and_mul_matches_the_torch_ops(dtype: torch.dtype, intermediate: int) -> None:
    g = torch.Generator().manual_seed(0)
    gate_up = (4 * torch.randn(3, 2 * intermediate, generator=g)).to(dtype)
    gate, up = gate_up.split(intermediate, dim=-1)
    out = silu_and_mul(gate_up)
    assert out.shape == (3, intermediate) and out.dtype == dtype
    torch.testing.assert_close(out, F.silu(gate) * up, **TOL[dtype])
    assert silu_and_mul(gate_up[:0]).shape == (0, intermediate)


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match=r"need gate_up \[T, 2I\]"):
        silu_and_mul(torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"need gate_up \[T, 2I\]"):
        silu_and_mul(torch.zeros(4, 2).t())
