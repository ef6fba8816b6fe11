"""Histograms of a worker's engine steps (time, requests, tokens), kept cumulatively
with fixed buckets and sent in its stats replies for the router's /metrics; and step
time by step size (requests, tokens), for the router's latency predictor.

Bookkeeping is O(1) per step (one perf_counter pair and a bisect over a dozen
bounds per histogram), never per token. A histogram goes on the wire as a
protocol.Histogram (bounds, per-bucket counts, sum, count; router/worker_metrics.py
reads it), step times by size as a protocol.StepTimes (protocol.stats.mean_points reads it).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from typing import TYPE_CHECKING

from protocol.stats import Histogram, StepTimes

if TYPE_CHECKING:  # `pdserve status` reads histograms with this module: no torch for it
    from engine.engine_core import EngineCore, StepOutput

STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
STEP_REQUESTS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STEP_TOKENS_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384)


def _increasing(bounds: tuple[float, ...], what: str) -> tuple[float, ...]:
    if not bounds or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{what} bounds must be non-empty and increasing, got {bounds}")
    return bounds


class FixedHistogram:
    """Cumulative counts over fixed upper bounds, Prometheus' way (a value equal to a
    bound falls in that bound's bucket)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = _increasing(bounds, "histogram")
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> Histogram:
        """The wire form; copies, so a later observe() changes nothing."""
        return Histogram(bounds=[float(b) for b in self.bounds], counts=list(self.counts), sum=self.sum,
                         count=self.count)


class FixedStepTimes:
    """Steps per bucket of their size (requests or tokens per step; fixed upper bounds,
    a size equal to a bound in that bound's bucket), with the sums of their sizes and of
    their seconds: the mean step time of each size range, which the size histogram and
    the time histogram apart cannot give."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = _increasing(bounds, "step size")
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sizes = [0.0] * (len(bounds) + 1)
        self.seconds = [0.0] * (len(bounds) + 1)

    def observe(self, size: float, seconds: float) -> None:
        i = bisect_left(self.bounds, size)
        self.counts[i] += 1
        self.sizes[i] += size
        self.seconds[i] += seconds

    def snapshot(self) -> StepTimes:
        """The wire form; copies, so a later observe() changes nothing."""
        return StepTimes(bounds=[float(b) for b in self.bounds], counts=list(self.counts), sizes=list(self.sizes),
                         seconds=list(self.seconds))


class StepMetrics:
    """One worker's step histograms (its stats replies' step_seconds, step_requests and
    step_tokens) and step times by size (step_seconds_by_requests, _by_tokens). Its
    core calls step() in place of engine.step()."""

    def __init__(self) -> None:
        self.seconds = FixedHistogram(STEP_SECONDS_BUCKETS)
        self.requests = FixedHistogram(STEP_REQUESTS_BUCKETS)
        self.tokens = FixedHistogram(STEP_TOKENS_BUCKETS)
        self.by_requests = FixedStepTimes(STEP_REQUESTS_BUCKETS)
        self.by_tokens = FixedStepTimes(STEP_TOKENS_BUCKETS)

    def step(self, engine: EngineCore) -> StepOutput:
        """engine.step(), timed. Only steps that computed tokens count: an idle call, or
        one that only waited for a grammar, says nothing about the batch's cost. (With
        async scheduling a call returns the previous step's output: its time is then
        the loop's period per step, which is what throughput sees.)"""
        start = time.perf_counter()
        out = engine.step()
        if out.num_tokens:
            self.observe(time.perf_counter() - start, out.num_requests, out.num_tokens)
        return out

    def observe(self, seconds: float, requests: int, tokens: int) -> None:
        self.seconds.observe(seconds)
        self.requests.observe(requests)
        self.tokens.observe(tokens)
        self.by_requests.observe(requests, seconds)
        self.by_tokens.observe(tokens, seconds)


def histogram_quantile(hist: Histogram, q: float) -> float | None:
    """The q-quantile (0 <= q <= 1) of a wire-form histogram, interpolated linearly
    within its bucket as Prometheus' histogram_quantile does (the first bucket from 0;
    past the last bound: that bound). None when it holds no observation."""
    counts, bounds = hist.counts, hist.bounds
    total = sum(counts)
    if total == 0:
        return None
    rank, seen = q * total, 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            if i == len(bounds):
                return float(bounds[-1])
            low = bounds[i - 1] if i else 0.0
            return low + (bounds[i] - low) * (rank - seen) / n
        seen += n
    return float(bounds[-1])
