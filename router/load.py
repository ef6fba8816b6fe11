"""What the deployment's load looks like now, as one typed record: the router's own
cumulative counters and latency histograms, and each worker's queue and KV figures
from a stats reply asked now. The autoscaling planner (cluster/autoscale/) takes two
snapshots and reads the window between them; the router only reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from protocol import WorkerStats

# (upper bound, cumulative count) per bucket, +Inf last: a histogram as it stands.
Buckets = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class WorkerLoad:
    """One worker as its stats reply has it (zeros when it did not answer)."""

    name: str
    role: str  # "decode" | "prefill"
    live: bool  # the router routes to it (or, for a prefill worker, it answers pings)
    draining: bool  # being scaled down: no new requests or jobs
    answered: bool  # its stats reply came in time (else the figures below are zeros)
    running: int = 0
    waiting: int = 0  # in its engine's queue
    kv_used: float = 0.0  # fraction of its KV blocks in use
    waiting_for_kv: int = 0  # a decode worker's requests whose prompt a prefill worker computes
    jobs: int = 0  # a prefill worker's remote prefills in flight
    tokens_computed: int = 0  # a prefill worker's prompt tokens computed so far (cumulative)


@dataclass(frozen=True)
class LoadSnapshot:
    at: float  # time.monotonic() when taken
    requests: float  # requests routed so far (cumulative)
    finished: float  # requests finished so far, any reason
    prompt_tokens: float  # cumulative
    generation_tokens: float  # cumulative
    in_flight: int  # requests the router serves now
    ttft: Buckets  # time to first token, cumulative
    tpot: Buckets  # time per output token, cumulative
    remote_prefill_min_tokens: int  # the threshold in force
    workers: tuple[WorkerLoad, ...]
    itl: Buckets = ()  # time between two tokens of a stream, cumulative (observed as tokens go out)
    prompt_lengths: Buckets = ()  # prompt tokens per sequence routed, cumulative

    def pool(self, role: str) -> tuple[WorkerLoad, ...]:
        """The workers of one pool that take work (live, not draining)."""
        return tuple(w for w in self.workers if w.role == role and w.live and not w.draining)


def buckets_of(histogram: Histogram) -> Buckets:
    """A prometheus_client Histogram's cumulative buckets (its `_bucket` samples)."""
    out = []
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                out.append((float(sample.labels["le"]), float(sample.value)))
    return tuple(sorted(out, key=lambda b: b[0]))


def total_of(counter: Counter) -> float:
    """A counter's total over all its labels."""
    return sum(s.value for metric in counter.collect() for s in metric.samples if s.name.endswith("_total"))


def quantile_between(old: Buckets, new: Buckets, q: float) -> float | None:
    """The q-quantile of what was observed between two snapshots of one histogram,
    interpolated within its bucket as Prometheus' histogram_quantile does; None if
    nothing was observed. Past the last finite bound: that bound."""
    before = dict(old)
    counts, bounds, seen = [], [], 0.0
    for le, cumulative in new:
        delta = cumulative - before.get(le, 0.0)
        counts.append(max(0.0, delta - seen))
        bounds.append(le)
        seen = max(seen, delta)
    total = sum(counts)
    if total <= 0:
        return None
    rank, acc = q * total, 0.0
    for i, n in enumerate(counts):
        if n and acc + n >= rank:
            if math.isinf(bounds[i]):
                return bounds[i - 1] if i else 0.0
            low = bounds[i - 1] if i else 0.0
            return low + (bounds[i] - low) * (rank - acc) / n
        acc += n
    finite = [b for b in bounds if not math.isinf(b)]
    return finite[-1] if finite else None


def worker_load(name: str, role: str, live: bool, draining: bool, stats: WorkerStats | None) -> WorkerLoad:
    """A worker's figures from its stats reply (None: it did not answer)."""
    if stats is None:
        return WorkerLoad(name, role, live, draining, answered=False)
    return WorkerLoad(name, role, live, draining, answered=True, running=stats.running, waiting=stats.waiting,
                      kv_used=stats.kv_used, waiting_for_kv=stats.waiting_for_kv or 0, jobs=stats.jobs or 0,
                      tokens_computed=stats.tokens_computed or 0)
