"""A decoder layer's elementwise glue in C for float32 on CPU (csrc/layer_ops_f32.c).

The same three functions, with the same signatures, as the GPU's Triton kernels
(engine/kernels/norm_rope.py and activation.py): the model's fused path calls whichever
set fits its tensors (engine/model/fused_ops.py).
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from engine.native import load_kernel, omp_threads

SOURCE = Path(__file__).parent / "csrc" / "layer_ops_f32.c"

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


@cache
def load() -> ctypes.CDLL | None:
    # Products and sums rounded one by one, as torch's separate ops round them.
    lib = load_kernel(SOURCE, ("-ffp-contract=off",), needs_avx2_fma=True)
    if lib is not None:
        for name in ("add_rms_norm_f32", "silu_and_mul_f32"):
            getattr(lib, name).restype = None
        lib.rotary_f32.restype = ctypes.c_int64
    return lib


def _lib() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(f"the C layer ops could not be built from {SOURCE}")
    return lib


def _check_f32_cpu(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name} must be float32 on CPU, got {t.dtype} on {t.device}")


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual), or (rms_norm(x) * weight, x)
    without a residual. x, residual: [T, H] with unit column stride; weight [H]."""
    if x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],) or not weight.is_contiguous():
        raise ValueError(f"need x [T, H] with contiguous rows and weight [H], got {tuple(x.shape)} "
                         f"(strides {x.stride()}) and {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"residual must match x: {tuple(residual.shape)} vs {tuple(x.shape)}")
    _check_f32_cpu(x=x, weight=weight, **({"residual": residual} if residual is not None else {}))
    rows, cols = x.shape
    out = torch.empty(rows, cols, dtype=torch.float32)
    new_residual = torch.empty_like(out) if residual is not None else x
    if rows:
        res = residual if residual is not None else x
        _lib().add_rms_norm_f32(_i64(rows), _i64(cols), _ptr(x.data_ptr()), _i64(x.stride(0)),
                                _ptr(residual.data_ptr() if residual is not None else None), _i64(res.stride(0)),
                                _ptr(weight.data_ptr()), ctypes.c_float(eps), _ptr(out.data_ptr()),
                                _ptr(new_residual.data_ptr() if residual is not None else None), omp_threads())
    return out, new_residual


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            positions: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place by the fp32 tables cos, sin
    [max_positions, D] (RotaryEmbedding's) at positions [T] (int64)."""
    t, hq, dim = q.shape
    if k.dim() != 3 or k.shape[0] != t or k.shape[2] != dim or q.stride(2) != 1 or k.stride(2) != 1 or dim % 2:
        raise ValueError(f"need q [T, Hq, D], k [T, Hk, D] with unit last stride and even D, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if (cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != dim or cos.stride() != sin.stride()
            or cos.stride(1) != 1 or positions.shape != (t,) or positions.dtype != torch.int64
            or not positions.is_contiguous()):
        raise ValueError(f"need fp32 tables [positions, {dim}] and int64 positions [{t}], got "
                         f"{tuple(cos.shape)} and {positions.dtype} {tuple(positions.shape)}")
    _check_f32_cpu(q=q, k=k, cos=cos, sin=sin)
    if positions.device.type != "cpu":
        raise ValueError(f"positions must be on CPU, got {positions.device}")
    if t == 0:
        return
    bad = _lib().rotary_f32(_i64(t), _i64(hq), _i64(k.shape[1]), _i64(dim),
                            _ptr(q.data_ptr()), _i64(q.stride(0)), _i64(q.stride(1)),
                            _ptr(k.data_ptr()), _i64(k.stride(0)), _i64(k.stride(1)),
                            _ptr(cos.data_ptr()), _ptr(sin.data_ptr()), _i64(cos.stride(0)), _i64(cos.shape[0]),
                            _ptr(positions.data_ptr()), omp_threads())
    if bad:
        raise ValueError(f"{bad} of {t} positions are outside the rotary tables [0, {cos.shape[0]}): "
                         f"{positions.min().item()}..{positions.max().item()}")


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] of shape [T, 2I] (contiguous rows)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"need gate_up [T, 2I] with contiguous rows, got {tuple(gate_up.shape)} "
                         f"(strides {gate_up.stride()})")
    _check_f32_cpu(gate_up=gate_up)
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=torch.float32)
    if rows:
        _lib().silu_and_mul_f32(_i64(rows), _i64(n), _ptr(gate_up.data_ptr()), _i64(gate_up.stride(0)),
                                _ptr(out.data_ptr()), omp_threads())
    return out
