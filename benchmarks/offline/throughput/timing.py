"""Timing helpers of the offline benchmark: a device sync, medians, and the machine's
matmul rate (the compute floor's denominator)."""

from __future__ import annotations

import statistics
import time

import torch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, device: str,
                  trials: int = 7, min_seconds: float = 0.25) -> list[float]:
    """GFLOP/s of torch.mm (m x k @ k x n), one figure per trial of >= min_seconds."""
    gen = torch.Generator().manual_seed(1234)
    a = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    with torch.inference_mode():
        for _ in range(3):
            torch.mm(a, b, out=out)
        sync(device)
        rates = []
        for _ in range(trials):
            iters = 0
            start = time.perf_counter()
            while True:
                torch.mm(a, b, out=out)
                iters += 1
                if iters % 4 == 0:
                    sync(device)
                    elapsed = time.perf_counter() - start
                    if elapsed >= min_seconds:
                        break
            rates.append(2.0 * m * k * n * iters / elapsed / 1e9)
    return rates


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))
