"""The two roofs of a device: memory bandwidth and peak FLOP/s. The H200's are the
datasheet figures the issue states; a CPU's (or any device's) are measured here: the
torch.mm rate (benchmarks/offline/throughput/timing.py) and a large tensor copy's bandwidth."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from benchmarks.gpu.shapes import HBM_BYTES_PER_S

H200_BF16_FLOPS = 760e12  # dense bf16 tensor-core peak, as issue 19 states it


@dataclass(frozen=True)
class Roof:
    name: str
    bytes_per_s: float
    flops_per_s: float

    def __post_init__(self) -> None:
        if self.bytes_per_s <= 0 or self.flops_per_s <= 0:
            raise ValueError(f"roof {self.name!r}: bandwidth and peak must be > 0, got "
                             f"{self.bytes_per_s} B/s and {self.flops_per_s} FLOP/s")

    @property
    def ridge(self) -> float:
        """The arithmetic intensity (FLOP/byte) where the two roofs meet."""
        return self.flops_per_s / self.bytes_per_s

    def attainable(self, intensity: float) -> float:
        return min(self.flops_per_s, intensity * self.bytes_per_s)


H200 = Roof("H200 (4.23 TB/s, 760 TFLOP/s bf16)", HBM_BYTES_PER_S, H200_BF16_FLOPS)


def copy_bandwidth(device: str, nbytes: int = 256 << 20, repeats: int = 7) -> float:
    """Bytes/s of dst.copy_(src) on two nbytes tensors, median of repeats; a copy reads
    nbytes and writes nbytes, so it moves 2 * nbytes."""
    import torch

    from benchmarks.gpu.timing import sync

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times)


def measured_roof(device: str, dtype: str, matmul_size: int = 1024, trials: int = 5) -> Roof:
    """The device's torch.mm rate in dtype (square matmul_size GEMMs, median of trials)
    and its copy bandwidth."""
    import torch

    from benchmarks.offline.throughput.timing import matmul_gflops, median

    n = matmul_size
    flops = median(matmul_gflops(n, n, n, getattr(torch, dtype), device, trials=trials, min_seconds=0.2)) * 1e9
    bandwidth = copy_bandwidth(device)
    return Roof(f"{device} measured ({bandwidth / 1e9:.1f} GB/s copy, {flops / 1e9:.0f} GFLOP/s {dtype} mm)",
                bandwidth, flops)
