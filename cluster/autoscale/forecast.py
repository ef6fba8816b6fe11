"""The planner's memory: each pool's load rate over its last few windows (projected one
look ahead along their trend), and each pool's per-worker throughput, learned from the
windows in which that pool was the bottleneck. Units are the pool's own: prompt tokens
per second for prefill, generated tokens per second for decode."""

from __future__ import annotations

import math
from collections import deque

TREND_POINTS = 3  # windows a trend is drawn through: enough to see a ramp, few enough to turn with it
CAPACITY_SAMPLES = 3  # busy windows a pool's per-worker capacity is the mean of
# A pool is planned to run at most this share of its learned capacity: the capacity is
# learned at the SLO's edge, where latency already breaches it.
MARGIN = 0.9


class Trend:
    """A rate's last few values, and where it is heading."""

    def __init__(self, points: int = TREND_POINTS) -> None:
        self._points: deque[tuple[float, float]] = deque(maxlen=points)

    def add(self, at: float, rate: float) -> None:
        if self._points and at <= self._points[-1][0]:
            return  # the same window again: no new information
        self._points.append((at, rate))

    @property
    def last(self) -> float:
        return self._points[-1][1] if self._points else 0.0

    def project(self, horizon_s: float) -> float:
        """The rate horizon_s after the last point, on the line from the oldest kept
        point to the last (flat with one point); never below zero."""
        if len(self._points) < 2:
            return self.last
        (t0, r0), (t1, r1) = self._points[0], self._points[-1]
        return max(0.0, r1 + (r1 - r0) / (t1 - t0) * horizon_s)


class Capacity:
    """One pool's throughput per worker, as far as it has been seen."""

    def __init__(self, samples: int = CAPACITY_SAMPLES) -> None:
        self._samples: deque[float] = deque(maxlen=samples)

    @property
    def per_worker(self) -> float | None:
        return sum(self._samples) / len(self._samples) if self._samples else None

    def learn(self, rate: float, workers: int) -> None:
        """A window in which the pool was the bottleneck: what it did is what it can do."""
        if workers > 0 and rate > 0:
            self._samples.append(rate / workers)

    def lift(self, rate: float, workers: int) -> None:
        """A window in which the pool was not the bottleneck: it can do at least this,
        so the estimate never asks for more workers than serve the current load within
        its targets (a stale, low estimate would otherwise pin the pool high)."""
        per_worker = self.per_worker
        if per_worker is not None and workers > 0 and rate / workers / MARGIN > per_worker:
            self._samples.clear()
            self._samples.append(rate / workers / MARGIN)

    def workers_for(self, rate: float) -> int | None:
        """Workers needed to serve `rate` at MARGIN of capacity; None before any is learned."""
        per_worker = self.per_worker
        if per_worker is None:
            return None
        return math.ceil(rate / (per_worker * MARGIN)) if rate > 0 else 0
