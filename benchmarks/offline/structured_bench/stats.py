"""Repeats and their summary: every figure is the median over repeats, with the
spread (min-max of the repeats) beside it, so a noisy machine shows as a wide spread."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Stat:
    """One figure: the median of `samples`, and their min and max."""

    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def show(self, scale: float = 1.0, digits: int = 2) -> str:
        """'median (min-max)' in the given unit (scale multiplies every sample)."""
        lo, mid, hi = (v * scale for v in (min(self.samples), self.median, max(self.samples)))
        return f"{mid:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"

    def to_dict(self) -> dict:
        return {"median": self.median, "min": min(self.samples), "max": max(self.samples), "n": len(self.samples)}


def per_call(fn: Callable[[], object], repeats: int, iters: int) -> Stat:
    """Seconds per call of fn: each repeat times `iters` calls and keeps the median call."""
    fn()  # warm-up
    medians = []
    for _ in range(repeats):
        calls = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            calls.append(time.perf_counter() - start)
        medians.append(statistics.median(calls))
    return Stat(medians)


def ratios(numerators: list[float], denominators: list[float]) -> Stat:
    """Paired ratios (each repeat against its own baseline): drift between repeats cancels."""
    return Stat([a / b for a, b in zip(numerators, denominators)])
