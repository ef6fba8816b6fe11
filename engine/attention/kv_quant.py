"""fp8 KV cache: a byte per element instead of two (or four), with per-layer scales.

A cached value is x / scale rounded to the fp8 format; attention reads it back as
fp8 * scale. Scales are per tensor: one k_scale and one v_scale per layer, from the
checkpoint when it has them (FP8 checkpoints calibrate them), else 1.0.

Why per tensor and not per block: fp8 is floating point, so a scale only moves the
window of exponents the format covers (e4m3: 2^-9 to 448, 3 mantissa bits at every
magnitude); the relative error of a value is the same whatever the scale, as long as
it is neither saturated nor subnormal. K and V of the models served here sit well
inside that window at scale 1.0 (docs/benchmarks/2026-12-06-fp8-kv.md measures the
largest ones), so a per-block scale would buy headroom that is not needed, at the cost
of a scale per block and head that every write must keep current (a decode token
larger than its block's scale requantizes the block) and every transfer must carry.
Static scales travel in the P/D handshake instead, and a peer with other scales is
refused (kv_transfer/compat.py): the receiver can never read a block under the wrong
scale.

The rounding happens once, in the model, before the K/V are stored: the model
computes with the rounded values (scale folded into the softmax scale and the output)
whether a token's K/V come fresh from the step or back from the cache, so a prompt's
tokens are the same whether it was chunked, hit the prefix cache, or was prefilled by
another worker. The backends only convert: a value already on the fp8 grid is stored
exactly, and read back exactly, in any of them.
"""

from __future__ import annotations

import torch

# kv_cache_dtype (engine/config.py) -> the cache's element type; "auto" is the model's.
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for an engine of `model_dtype`."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(FP8_DTYPES)}, got {kv_cache_dtype!r}")
    return FP8_DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def round_to_cache(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale on the grid of fp8 `dtype`, in x's dtype: what the cache will hold.
    Saturated to the format's largest finite value (torch's conversion would make an
    e5m2 overflow inf); NaN stays NaN."""
    limit = torch.finfo(dtype).max
    y = x / scale if scale != 1.0 else x
    return y.clamp(-limit, limit).to(dtype).to(x.dtype)


def readable(cached: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache contents in a dtype torch computes in: fp8 widened (exactly) to `dtype`;
    anything else as it is."""
    return cached.to(dtype) if is_fp8(cached.dtype) else cached


def fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """[256] float32: the value of every fp8 byte (the C decode kernel's lookup)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float().contiguous()
