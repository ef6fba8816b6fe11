"""Fused SiLU-and-multiply (the gated MLP's activation), for 16-bit models on a GPU.

`F.silu(gate) * up` is two launches and a round trip of the [T, I] intermediate
through memory; here one program per (row, column block) reads gate and up once and
writes the product. Numerics follow the torch path: SiLU in fp32, rounded to the
activation dtype, then the product in fp32, rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] of shape [T, 2I] (contiguous rows)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"need gate_up [T, 2I] with contiguous rows, got {tuple(gate_up.shape)} "
                         f"(strides {gate_up.stride()})")
    n = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0]:
        _silu_and_mul_kernel[(gate_up.shape[0], triton.cdiv(n, BLOCK))](
            gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4)
    return out
