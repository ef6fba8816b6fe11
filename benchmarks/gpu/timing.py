"""Timing helpers of the GPU check: wall time with a device sync, and GPU time of a
kernel launch through a CUDA graph."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], None], device: str, repeats: int) -> float:
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_seconds(fn: Callable[[], None], device: str, calls: int = 20, repeats: int = 10) -> float:
    """GPU time of one fn() call: `calls` calls captured in a CUDA graph and replayed, so
    the launchers' Python (tens of microseconds, as long as a decode kernel) is not
    timed; in the engine these kernels run inside CUDA graphs too. CPU: wall time."""
    if not device.startswith("cuda"):
        return median_seconds(fn, device, 1)
    import torch

    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_seconds(graph.replay, device, repeats) / calls
