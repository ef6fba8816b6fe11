"""Workers' step histograms and speculative decoding counters, as Prometheus
histograms and counters labelled by worker and role.

Each worker keeps its own cumulative histograms (workers/step_metrics.py has the wire
form: bounds, per-bucket counts, sum, count) and, while it speculates, its counters
(protocol SpecDecodeStats), and sends them in its stats replies; the router keeps the
latest per worker and yields them at each scrape through custom collectors, so that
nothing is re-observed here and a restarted worker's counts start over as a counter's
do. A figure that does not have its wire form is left out (and logged), never a failed
scrape.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from engine.speculative.metrics import PER_POSITION, SPEC_DECODE_COUNTERS
from protocol import MessageError, SpecDecodeStats

logger = logging.getLogger(__name__)

STEP_HISTOGRAMS = {  # stats key -> (metric, help)
    "step_seconds": ("pdserve_worker_step_seconds", "wall time of the worker's engine steps that computed tokens"),
    "step_requests": ("pdserve_worker_step_requests", "requests in each engine step (its batch size)"),
    "step_tokens": ("pdserve_worker_step_tokens", "tokens computed in each engine step"),
}
Buckets = list[tuple[str, float]]  # (le, cumulative count), "+Inf" last: HistogramMetricFamily's form


def prometheus_buckets(hist: Any) -> tuple[Buckets, float]:
    """A wire-form histogram as HistogramMetricFamily buckets and sum; ValueError
    naming what is wrong when it is not one."""
    if not isinstance(hist, dict):
        raise ValueError(f"a histogram is a map, got {type(hist).__name__}")
    bounds, counts, total = hist.get("bounds"), hist.get("counts"), hist.get("sum")
    if not isinstance(bounds, list) or not bounds or not all(_finite(b) for b in bounds) \
            or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"bounds must be a non-empty increasing list of numbers, got {bounds!r}")
    if not isinstance(counts, list) or len(counts) != len(bounds) + 1 \
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        raise ValueError(f"counts must be {len(bounds) + 1} counts (one per bound, then +Inf), got {counts!r}")
    if not _finite(total):
        raise ValueError(f"sum must be a number, got {total!r}")
    buckets, seen = [], 0
    for le, n in zip([*map(float, bounds), math.inf], counts):
        seen += n
        buckets.append((floatToGoString(le), float(seen)))
    return buckets, float(total)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class WorkerHistograms(Collector):
    """The latest step histograms of every worker that answered a scrape (update()),
    yielded by collect() as one histogram family per STEP_HISTOGRAMS entry."""

    def __init__(self) -> None:
        self._latest: dict[tuple[str, str], dict[str, tuple[Buckets, float]]] = {}  # (worker, role) -> key ->

    def forget(self, worker: str, role: str) -> None:
        """The worker left its pool (scaled down): its series go."""
        self._latest.pop((worker, role), None)

    def update(self, worker: str, role: str, stats: dict[str, Any]) -> None:
        """One worker's stats reply (role: "decode" or "prefill")."""
        hists = self._latest.setdefault((worker, role), {})
        for key in STEP_HISTOGRAMS:
            if key not in stats:
                continue
            try:
                hists[key] = prometheus_buckets(stats[key])
            except ValueError as exc:
                logger.warning("worker %s sent a malformed %s histogram, left out of /metrics: %s", worker, key, exc)
                hists.pop(key, None)

    def describe(self) -> Iterator[HistogramMetricFamily]:
        for name, help_ in STEP_HISTOGRAMS.values():
            yield HistogramMetricFamily(name, help_, labels=["worker", "role"])

    def collect(self) -> Iterator[HistogramMetricFamily]:
        for key, (name, help_) in STEP_HISTOGRAMS.items():
            family = HistogramMetricFamily(name, help_, labels=["worker", "role"])
            for (worker, role), hists in sorted(self._latest.items()):
                if key in hists:
                    family.add_metric([worker, role], *hists[key])
            yield family


class WorkerSpecDecode(Collector):
    """The latest speculative decoding counters of every worker that reported them
    (update(): its stats reply's "spec_decode"), yielded by collect() as counters named
    in engine/speculative/metrics.py; accepted tokens per draft position are labelled
    position="i". A worker that does not speculate adds no sample."""

    def __init__(self) -> None:
        self._latest: dict[tuple[str, str], SpecDecodeStats] = {}  # (worker, role) ->

    def forget(self, worker: str, role: str) -> None:
        """The worker left its pool (scaled down): its series go."""
        self._latest.pop((worker, role), None)

    def update(self, worker: str, role: str, stats: dict[str, Any]) -> None:
        if "spec_decode" not in stats:
            self._latest.pop((worker, role), None)  # restarted without speculation
            return
        try:
            self._latest[(worker, role)] = SpecDecodeStats.from_stats(stats["spec_decode"])
        except MessageError as exc:
            logger.warning("worker %s sent malformed speculative decoding counters, left out of /metrics: %s",
                           worker, exc)
            self._latest.pop((worker, role), None)

    def describe(self) -> Iterator[CounterMetricFamily]:
        for name, help_ in (*SPEC_DECODE_COUNTERS.values(), PER_POSITION):
            labels = ["worker", "role", "position"] if name == PER_POSITION[0] else ["worker", "role"]
            yield CounterMetricFamily(name, help_, labels=labels)

    def collect(self) -> Iterator[CounterMetricFamily]:
        latest = sorted(self._latest.items())
        for key, (name, help_) in SPEC_DECODE_COUNTERS.items():
            family = CounterMetricFamily(name, help_, labels=["worker", "role"])
            for (worker, role), spec in latest:
                family.add_metric([worker, role], getattr(spec, key))
            yield family
        family = CounterMetricFamily(*PER_POSITION, labels=["worker", "role", "position"])
        for (worker, role), spec in latest:
            for position, count in enumerate(spec.accepted_per_position):
                family.add_metric([worker, role, str(position)], count)
        yield family
