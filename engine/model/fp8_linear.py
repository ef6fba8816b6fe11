"""fp8 weights: a linear layer whose weight is float8 (e4m3) with a float32 scale per
output channel, from an FP8 checkpoint or quantized at load (`quantization: fp8`).

On CUDA with fp8 tensor cores (sm_89+) the product is torch._scaled_mm: activations
are quantized per token (each row's amax / 448, computed every call: dynamic), so the
GEMM reads a byte per weight and runs at fp8 rate. Elsewhere (CPU, older GPUs, shapes
_scaled_mm refuses) the weight is dequantized in the call and multiplied in the
activations' dtype: weight-only fp8, correct and not fast.

Which linears: the decoder layers' attention and dense MLP projections (and MLA's
query and latent projections). Not the embedding, lm_head, a mixture of experts'
router or its stacked experts (engine/model/moe.py has no fp8 path): those stay in the
model's dtype, as vLLM's fp8 also leaves the router and lm_head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.group import SINGLE, Group

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# Our parameter names (engine/model/llama.py, mla.py) of the linears fp8 replaces.
TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "q_proj", "q_a_proj", "q_b_proj",
           "kv_a_proj_with_mqa")
# Row-parallel under tensor parallelism: a rank holds a slice of each output channel's
# inputs, so a channel's scale needs the amax over every rank's slice.
ROW_PARALLEL = ("o_proj", "down_proj")


class Fp8Linear(nn.Module):
    """y = x @ (weight * weight_scale[:, None]).T + bias; weight [out, in] float8_e4m3fn."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None

    @classmethod
    def quantize(cls, linear: nn.Linear, amax: torch.Tensor | None = None) -> Fp8Linear:
        """`linear` with its weight quantized per output channel (amax: each channel's
        largest |w|, when the caller knows it over more than this weight's columns)."""
        w = linear.weight.detach()
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, w.device)
        if amax is None:
            amax = w.abs().amax(dim=1).float()
        scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        out.weight.data = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        out.weight_scale.data = scale
        if linear.bias is not None and out.bias is not None:  # both or neither
            out.bias.data = linear.bias.detach().clone()
        return out

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _scaled_mm_ok(x, self.out_features):
            return _fp8_gemm(x, self.weight, self.weight_scale, self.bias)
        return F.linear(x, self.dequantized(x.dtype), self.bias)


def _scaled_mm_ok(x: torch.Tensor, out_features: int) -> bool:
    """_scaled_mm needs fp8 tensor cores and both GEMM dims of the weight a multiple of 16."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.shape[-1] % 16 == 0
            and out_features % 16 == 0 and torch.cuda.get_device_capability(x.device) >= (8, 9))


def _fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] per-token quantized, times the fp8 weight, rowwise scales on both sides."""
    rows = x.reshape(-1, x.shape[-1])
    x_scale = (rows.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    xq = (rows.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale[None, :].contiguous(),
                         bias=bias, out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def fp8_targets(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) of every linear fp8 replaces, in the decoder layers."""
    return [(parent, name, child) for full, parent in model.named_modules() if full.startswith("layers.")
            for name, child in parent.named_children()
            if name in TARGETS and isinstance(child, nn.Linear)]


def quantize_linears(model: nn.Module, group: Group = SINGLE) -> int:
    """Online fp8: every target linear quantized per output channel from its loaded
    weight. Under tensor parallelism a row-parallel layer's channel amax is taken over
    every rank's slice (all ranks call this together), so each rank's scales are the
    unsharded model's: the same quantized weights at any TP size."""
    targets = fp8_targets(model)
    for parent, name, linear in targets:
        amax = None
        if name in ROW_PARALLEL and group.size > 1:
            amax = _amax_over_ranks(linear.weight.detach().abs().amax(dim=1).float(), group)
        setattr(parent, name, Fp8Linear.quantize(linear, amax))
    return len(targets)


def _amax_over_ranks(local: torch.Tensor, group: Group) -> torch.Tensor:
    """The elementwise max over ranks, through the group's sum: each rank's values in its
    own row of zeros, summed, then the max over rows."""
    rows = local.new_zeros(group.size, local.numel())
    rows[group.rank] = local
    return group.all_reduce_(rows).amax(dim=0)


def checkpoint_linears(model: nn.Module, quantized: set[str]) -> int:
    """Empty Fp8Linears in place of the target linears whose checkpoint weights are fp8
    (`quantized`: our parameter names of those weights), for the loader to fill."""
    count = 0
    for full, parent in model.named_modules():
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and f"{full}.{name}.weight" in quantized:
                w = child.weight
                setattr(parent, name, Fp8Linear(child.in_features, child.out_features, child.bias is not None,
                                                w.dtype, w.device))
                count += 1
    return count
