"""Workers' step histograms, speculative decoding counters and KV offload tiers, as
Prometheus histograms, counters and gauges labelled by worker and role.

Each worker keeps its own cumulative histograms (protocol.Histogram: bounds,
per-bucket counts, sum, count) and, while it speculates, its counters (protocol
SpecDecodeStats), and sends them in its stats replies, whose decoding has checked
them; the router keeps the latest per worker and yields them at each scrape through
custom collectors, so that nothing is re-observed here and a restarted worker's counts
start over as a counter's do.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from engine.speculative.metrics import PER_POSITION, SPEC_DECODE_COUNTERS
from protocol import Histogram, KVTierStats, SpecDecodeStats, WorkerStats

STEP_HISTOGRAMS = {  # WorkerStats field -> (metric, help)
    "step_seconds": ("pdserve_worker_step_seconds", "wall time of the worker's engine steps that computed tokens"),
    "step_requests": ("pdserve_worker_step_requests", "requests in each engine step (its batch size)"),
    "step_tokens": ("pdserve_worker_step_tokens", "tokens computed in each engine step"),
}
Buckets = list[tuple[str, float]]  # (le, cumulative count), "+Inf" last: HistogramMetricFamily's form


def prometheus_buckets(hist: Histogram) -> tuple[Buckets, float]:
    """A worker's histogram as HistogramMetricFamily buckets and sum."""
    buckets, seen = [], 0
    for le, n in zip([*hist.bounds, math.inf], hist.counts):
        seen += n
        buckets.append((floatToGoString(le), float(seen)))
    return buckets, hist.sum


class WorkerHistograms(Collector):
    """The latest step histograms of every worker that answered a scrape (update()),
    yielded by collect() as one histogram family per STEP_HISTOGRAMS entry."""

    def __init__(self) -> None:
        self._latest: dict[tuple[str, str], dict[str, tuple[Buckets, float]]] = {}  # (worker, role) -> field ->

    def forget(self, worker: str, role: str) -> None:
        """The worker left its pool (scaled down): its series go."""
        self._latest.pop((worker, role), None)

    def update(self, worker: str, role: str, stats: WorkerStats) -> None:
        """One worker's stats reply (role: "decode" or "prefill")."""
        self._latest[(worker, role)] = {field: prometheus_buckets(getattr(stats, field)) for field in STEP_HISTOGRAMS}

    def describe(self) -> Iterator[HistogramMetricFamily]:
        for name, help_ in STEP_HISTOGRAMS.values():
            yield HistogramMetricFamily(name, help_, labels=["worker", "role"])

    def collect(self) -> Iterator[HistogramMetricFamily]:
        for key, (name, help_) in STEP_HISTOGRAMS.items():
            family = HistogramMetricFamily(name, help_, labels=["worker", "role"])
            for (worker, role), hists in sorted(self._latest.items()):
                family.add_metric([worker, role], *hists[key])
            yield family


class WorkerSpecDecode(Collector):
    """The latest speculative decoding counters of every worker that reported them
    (update(): its stats reply's spec_decode), yielded by collect() as counters named
    in engine/speculative/metrics.py; accepted tokens per draft position are labelled
    position="i". A worker that does not speculate adds no sample."""

    def __init__(self) -> None:
        self._latest: dict[tuple[str, str], SpecDecodeStats] = {}  # (worker, role) ->

    def forget(self, worker: str, role: str) -> None:
        """The worker left its pool (scaled down): its series go."""
        self._latest.pop((worker, role), None)

    def update(self, worker: str, role: str, stats: WorkerStats) -> None:
        if stats.spec_decode is None:
            self._latest.pop((worker, role), None)  # restarted without speculation
        else:
            self._latest[(worker, role)] = stats.spec_decode

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


TIER_GAUGES = {  # TierUsage field -> (metric, help), labelled by tier too
    "capacity_blocks": ("pdserve_kv_tier_capacity_blocks", "KV blocks the worker's offload tier holds at most"),
    "used_blocks": ("pdserve_kv_tier_used_blocks", "KV blocks in the worker's offload tier"),
}
TIER_HITS = ("pdserve_kv_tier_hits_blocks", "KV blocks loaded back from the worker's offload tier (total)")
TIER_COUNTERS = {  # KVTierStats field -> (metric, help)
    "offloaded_bytes": ("pdserve_kv_offloaded_bytes", "KV bytes copied from the device pool to the host tier (total)"),
    "loaded_bytes": ("pdserve_kv_loaded_bytes", "KV bytes loaded back from the offload tiers (total)"),
    "loads": ("pdserve_kv_tier_loads", "requests whose prefix was loaded back from an offload tier (total)"),
    "load_seconds": ("pdserve_kv_tier_load_seconds", "those loads' time, submit to done, summed (total)"),
    "failed_loads": ("pdserve_kv_tier_failed_loads",
                     "loads refused (checksum mismatch) or failed (I/O): the prefix was computed (total)"),
    "dropped_blocks": ("pdserve_kv_tier_dropped_blocks", "evicted KV blocks not kept: every host slot busy (total)"),
}


class WorkerKVTiers(Collector):
    """The latest KV offload tier figures of every worker that has tiers (update():
    its stats reply's kv_tiers): usage gauges and hits per tier, and counters. The mean
    load latency is rate(pdserve_kv_tier_load_seconds_total) / rate(pdserve_kv_tier_loads_total)."""

    def __init__(self) -> None:
        self._latest: dict[tuple[str, str], KVTierStats] = {}  # (worker, role) ->

    def forget(self, worker: str, role: str) -> None:
        self._latest.pop((worker, role), None)

    def update(self, worker: str, role: str, stats: WorkerStats) -> None:
        if stats.kv_tiers is None:
            self._latest.pop((worker, role), None)
        else:
            self._latest[(worker, role)] = stats.kv_tiers

    def describe(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        return self._families()

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        return self._families(sorted(self._latest.items()))

    @staticmethod
    def _families(latest: list[tuple[tuple[str, str], KVTierStats]] | None = None
                  ) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        rows = latest or []
        per_tier = ["worker", "role", "tier"]
        for key, (name, help_) in TIER_GAUGES.items():
            gauge = GaugeMetricFamily(name, help_, labels=per_tier)
            for (worker, role), kv in rows:
                for tier in kv.tiers:
                    gauge.add_metric([worker, role, tier.name], getattr(tier, key))
            yield gauge
        hits = CounterMetricFamily(*TIER_HITS, labels=per_tier)
        for (worker, role), kv in rows:
            for tier in kv.tiers:
                hits.add_metric([worker, role, tier.name], tier.hits)
        yield hits
        for key, (name, help_) in TIER_COUNTERS.items():
            counter = CounterMetricFamily(name, help_, labels=["worker", "role"])
            for (worker, role), kv in rows:
                counter.add_metric([worker, role], getattr(kv, key))
            yield counter
