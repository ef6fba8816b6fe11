"""Fused RMSNorm (with the residual add) and rotary embedding, for 16-bit models on a GPU.

In a decode step at a large batch each of these is a handful of elementwise torch ops
over a megabyte: a dozen small launches a layer, together about as long as the step's
attention (docs/benchmarks/2026-11-30-gpu-check-h200.md: where the b256 step's time goes). One
program per token row here does each in one launch.

Numerics follow the model's torch path where it rounds: the residual add is rounded to
the activation dtype before it is normalised, and the norm's weight multiplies the
normalised value after it is cast back, as transformers does. The rotation itself is
computed in fp32 and rounded once (torch rounds each product), so it is not bit-equal
to the torch path; float32 models keep the torch path (engine/model/llama.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.common import next_power_of_2


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                         stride_x, stride_r, stride_o, stride_ro,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = w * h.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual), or (rms_norm(x) * weight, x)
    without a residual. x, residual: [T, H] with unit column stride; weight [H]."""
    if x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"need x [T, H] with contiguous rows and weight [H], got {tuple(x.shape)} "
                         f"(strides {x.stride()}) and {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"residual must match x: {tuple(residual.shape)} {residual.dtype} vs "
                         f"{tuple(x.shape)} {x.dtype}")
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x) if residual is not None else x
    if x.shape[0] == 0:
        return out, new_residual
    res = residual if residual is not None else x
    block = next_power_of_2(x.shape[1])
    _add_rms_norm_kernel[(x.shape[0],)](x, res, weight, out, new_residual, x.shape[1], eps,
                                        x.stride(0), res.stride(0), out.stride(0), new_residual.stride(0),
                                        HAS_RESIDUAL=residual is not None, BLOCK=block,
                                        num_warps=min(16, max(1, block // 256)))
    return out, new_residual


@triton.jit
def _rotate_heads(ptr, t, stride_t, stride_h, cos, sin, d, H: tl.constexpr, H_PAD: tl.constexpr,
                  HALF: tl.constexpr):
    h = tl.arange(0, H_PAD)
    mask = (h < H)[:, None]
    first = ptr + t * stride_t + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(first, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(first + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_table, HQ: tl.constexpr, HK: tl.constexpr, HQ_PAD: tl.constexpr,
                   HK_PAD: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    # The tables hold cat(freqs, freqs): the first half serves both halves.
    cos = tl.load(cos_ptr + pos * stride_table + d)[None, :]
    sin = tl.load(sin_ptr + pos * stride_table + d)[None, :]
    _rotate_heads(q_ptr, t, stride_qt, stride_qh, cos, sin, d, HQ, HQ_PAD, HALF)
    _rotate_heads(k_ptr, t, stride_kt, stride_kh, cos, sin, d, HK, HK_PAD, HALF)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            positions: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place by the fp32 tables cos, sin
    [max_positions, D] (RotaryEmbedding's) at positions [T] (int64)."""
    t, hq, dim = q.shape
    if k.shape[0] != t or k.shape[2] != dim or q.stride(2) != 1 or k.stride(2) != 1 or dim % 2:
        raise ValueError(f"need q [T, Hq, D], k [T, Hk, D] with unit last stride and even D, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if cos.shape != sin.shape or cos.shape[1] != dim or cos.dtype != torch.float32 or positions.shape != (t,):
        raise ValueError(f"need fp32 tables [positions, {dim}] and positions [{t}], got {tuple(cos.shape)} "
                         f"{cos.dtype} and {tuple(positions.shape)}")
    if t == 0:
        return
    hk = k.shape[1]
    _rotary_kernel[(t,)](q, k, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                         cos.stride(0), HQ=hq, HK=hk, HQ_PAD=next_power_of_2(hq), HK_PAD=next_power_of_2(hk),
                         HALF=dim // 2)
