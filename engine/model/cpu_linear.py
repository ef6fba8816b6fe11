"""Linear layers with weights packed once at load time, for CPU float32 inference.

A plain fp32 F.linear (MKL sgemm) re-lays-out the weight on every call, which is slow
at decode batch sizes. Two packed forms replace it (their speeds:
docs/benchmarks/2026-11-30-cpu-kernels.md):

- PanelLinear: pdserve's C kernel (csrc/linear_f32.c) on AVX2/FMA CPUs. Decode is
  bound by reading the weights, and the kernel streams them near the memory's speed:
  faster than oneDNN at 1-16 rows, on par at prefill sizes.
- PackedLinear: oneDNN's reordered weight (faster than F.linear at most decode sizes),
  where the C kernel cannot be built.

Both give the same numbers as nn.Linear up to float32 rounding; the HF fidelity tests
hold the engine to identical greedy tokens with them.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
from torch import nn

from engine.native import load_kernel, omp_threads

SOURCE = Path(__file__).parent / "csrc" / "linear_f32.c"
PANEL = 16  # output columns per panel: the C file's NR


def prepack_supported(device: str, dtype: torch.dtype) -> bool:
    return device == "cpu" and dtype == torch.float32 and (
        panel_kernel() is not None or torch.backends.mkldnn.is_available())


@cache
def panel_kernel() -> ctypes.CDLL | None:
    lib = load_kernel(SOURCE, needs_avx2_fma=True)
    if lib is not None:
        lib.linear_f32.restype = None
    return lib


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/16), K, 16] with panels[p, k, j] = weight[16p + j, k], zero past N."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=torch.float32)
    padded[:n] = weight
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


class PanelLinear(nn.Module):
    """Drop-in for an inference-only fp32 nn.Linear on CPU: x [T, in] -> [T, out]."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        lib = panel_kernel()
        if lib is None:
            raise RuntimeError(f"the C linear kernel could not be built from {SOURCE}")
        self.lib = lib
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Kernel layout: not a parameter, never saved or loaded.
        self.panels = pack_panels(linear.weight.detach().float())
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"PanelLinear({self.in_features} -> {self.out_features}) takes a float32 "
                             f"CPU [T, {self.in_features}] input, got {x.dtype} {tuple(x.shape)} on {x.device}")
        if x.stride(1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        if rows:
            ptr, i64 = ctypes.c_void_p, ctypes.c_int64
            self.lib.linear_f32(i64(rows), i64(self.out_features), i64(self.in_features),
                                ptr(x.data_ptr()), i64(x.stride(0)), ptr(self.panels.data_ptr()),
                                ptr(None if self.bias is None else self.bias.data_ptr()), ptr(y.data_ptr()),
                                omp_threads())
        return y


class PackedLinear(nn.Module):
    """oneDNN's form of the same drop-in, for CPUs without AVX2/FMA or a C compiler."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Opaque oneDNN layout: not a parameter, never saved or loaded.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def prepack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` by a PanelLinear (or, without the C kernel, a
    PackedLinear); returns how many."""
    packed = PanelLinear if panel_kernel() is not None else PackedLinear
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, packed(child))
    return len(targets)
