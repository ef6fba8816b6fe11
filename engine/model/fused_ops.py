"""Which fused layer ops (residual add + RMSNorm, rotary in place, SiLU-and-mul) the
model uses for its activations, if any.

- 16-bit on a GPU: Triton kernels (engine/kernels/norm_rope.py, activation.py), a few
  launches a layer instead of dozens.
- float32 on CPU: C (engine/model/cpu_ops.py), a few calls a layer instead of dozens of
  torch ops, where the C file builds.
- otherwise (float32 on a GPU, 16-bit on CPU, no compiler): None, the plain torch ops,
  which match transformers bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from engine.model.rope import apply_rotary


@dataclass(frozen=True)
class FusedOps:
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_: Callable[..., None]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]


@cache
def triton_ops() -> FusedOps:
    from engine.kernels.activation import silu_and_mul
    from engine.kernels.norm_rope import add_rms_norm, rotary_

    def any_width_rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          positions: torch.Tensor) -> None:
        # The kernel turns half a head's rotary dims as one power-of-two block: other
        # widths (Phi-3-mini's 96 dims, Phi-4-mini's 3/4 of 128) rotate in torch, in place.
        half = q.shape[-1] // 2
        if half & (half - 1) == 0:
            rotary_(q, k, cos, sin, positions)
            return
        rotated = apply_rotary(q, k, cos[positions].to(q.dtype)[:, None, :], sin[positions].to(q.dtype)[:, None, :])
        q.copy_(rotated[0])
        k.copy_(rotated[1])

    return FusedOps(add_rms_norm, any_width_rotary_, silu_and_mul)


@cache
def cpu_ops() -> FusedOps | None:
    from engine.model import cpu_ops as c

    return FusedOps(c.add_rms_norm, c.rotary_, c.silu_and_mul) if c.load() is not None else None


def fused_ops(x: torch.Tensor) -> FusedOps | None:
    if x.is_cuda:
        return triton_ops() if x.dtype != torch.float32 else None
    return cpu_ops() if x.dtype == torch.float32 else None
