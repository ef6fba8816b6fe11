"""A worker's figures, as its StatsReply carries them: one typed record for both roles.

The fields both roles have are required; those of one role only are None on the other
(and left out of the wire form and of /status's JSON: omit_defaults). Decoding checks
every field as it does a message's (protocol/wire.py), so the router, `pdserve status`,
/metrics and the autoscaling planner read attributes, never keys they must re-check.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated

import msgspec

if TYPE_CHECKING:
    from engine.kv_cache.tiers import OffloadStats

Count = Annotated[int, msgspec.Meta(ge=0)]


class Record(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of the records nested in a message (no `kind`, no `v`: the message has them)."""


def _check_bounds(bounds: list[float]) -> None:
    """A bucketed record's upper bounds (Histogram, StepTimes): non-empty, increasing, finite."""
    if not bounds or not all(map(math.isfinite, bounds)) or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"bounds must be a non-empty increasing list of finite numbers, got {bounds!r}")


class Histogram(Record, frozen=True):
    """A cumulative histogram over fixed upper bounds (workers/step_metrics.py keeps
    them): counts[i] observations in (bounds[i-1], bounds[i]], not cumulative; the last,
    counts[len(bounds)], above every bound (+Inf)."""

    bounds: list[float]  # increasing, finite (Prometheus' `le`)
    counts: list[Count]  # len(bounds) + 1
    sum: float
    count: Count

    def __post_init__(self) -> None:
        # A ValueError here is a ValidationError naming the field when decoded.
        _check_bounds(self.bounds)
        if len(self.counts) != len(self.bounds) + 1:
            raise ValueError(f"counts must be {len(self.bounds) + 1} (one per bound, then +Inf), "
                             f"got {len(self.counts)}")
        if not math.isfinite(self.sum):
            raise ValueError(f"sum must be finite, got {self.sum!r}")


class StepTimes(Record, frozen=True):
    """Engine steps by their size (requests, or tokens, per step): per bucket of that size,
    how many steps, the sizes' sum and the seconds' sum; a mean step time per size, which
    one histogram of each cannot give (workers/step_metrics.py keeps them; mean_points
    reads them). Bucket i holds sizes in (bounds[i-1], bounds[i]]."""

    bounds: list[float]  # increasing, finite upper bounds of the size
    counts: list[Count]  # len(bounds) + 1: steps per bucket, the last above every bound
    sizes: list[float]  # len(bounds) + 1: the sum of the sizes of those steps
    seconds: list[float]  # len(bounds) + 1: the sum of their wall times

    def __post_init__(self) -> None:
        # A ValueError here is a ValidationError naming the field when decoded.
        _check_bounds(self.bounds)
        for name in ("counts", "sizes", "seconds"):
            values = getattr(self, name)
            if len(values) != len(self.bounds) + 1:
                raise ValueError(f"{name} must be {len(self.bounds) + 1} (one per bound, then +Inf), "
                                 f"got {len(values)}")
        for name in ("sizes", "seconds"):
            if not all(math.isfinite(v) and v >= 0 for v in getattr(self, name)):
                raise ValueError(f"{name} must be finite sums >= 0, got {getattr(self, name)!r}")


def mean_points(t: StepTimes) -> list[tuple[float, float]]:
    """(mean size, mean seconds) of each bucket that holds a step, in size order: the
    points a latency predictor fits step time against batch size or step tokens."""
    return [(size / n, seconds / n) for n, size, seconds in zip(t.counts, t.sizes, t.seconds) if n]


class SpecDecodeStats(Record, frozen=True):
    """A speculating decode worker's counters since it started (the engine's SpecStats
    fields); a worker that does not speculate sends none."""

    num_drafts: Count  # request steps that verified at least one draft token
    num_draft_tokens: Count
    num_accepted_tokens: Count
    accepted_per_position: list[Count]  # [k]: drafts accepted at position i (0: right after the last token)
    num_disabled: Count  # requests that stopped speculating (low acceptance)


class TierUsage(Record, frozen=True):
    """One KV offload tier of a worker (the engine's TierUsage)."""

    name: str  # "host", "disk" or "shared"
    capacity_blocks: Count
    used_blocks: Count
    hits: Count  # blocks loaded back from it (total)


class KVTierStats(Record, frozen=True):
    """A worker's KV offload tiers since it started (the engine's OffloadStats); a
    worker without tiers sends none."""

    tiers: list[TierUsage]  # host, then disk, then shared
    offloaded_bytes: Count  # device pool -> host tier
    loaded_bytes: Count  # tiers -> device pool
    loads: Count  # requests whose prefix was loaded back
    load_seconds: float  # their loads' time, summed
    failed_loads: Count  # checksum mismatch or I/O error: computed instead
    dropped_blocks: Count  # evicted while every host slot was busy

    @classmethod
    def of(cls, o: OffloadStats | None) -> KVTierStats | None:
        """The engine's figures as a stats reply carries them (None: no tiers)."""
        if o is None:
            return None
        return cls(tiers=[TierUsage(name=t.name, capacity_blocks=t.capacity_blocks, used_blocks=t.used_blocks,
                                    hits=t.hits) for t in o.tiers],
                   offloaded_bytes=o.offloaded_bytes, loaded_bytes=o.loaded_bytes, loads=o.loads,
                   load_seconds=o.load_seconds, failed_loads=o.failed_loads, dropped_blocks=o.dropped_blocks)


class WorkerStats(Record, frozen=True, omit_defaults=True):
    """What a worker reports of itself (docs/api.md, /status; router/metrics.py's gauges
    are named after these fields). Totals count since the worker started."""

    # Both roles.
    name: str
    num_blocks: Count  # KV blocks in its pool
    free_blocks: Count  # free or only cached
    running: Count  # requests scheduled in the last step or about to be
    waiting: Count  # queued in its engine
    preemptions: Count  # total
    ranks: list[int]  # the process id of each tensor-parallel rank, rank 0 first
    refused_peers: Count  # peers refused so far for lacking the deployment's secret (total)
    stalled: bool  # for good: it exits soon (workers/watchdog.py)
    no_progress_s: float  # how long its pending work has gone without a step computing a token
    step_seconds: Histogram  # wall time of its engine steps that computed tokens
    step_requests: Histogram  # requests per such step
    step_tokens: Histogram  # tokens per such step
    # Step time by requests, and by tokens, per step: a latency predictor's input
    # (mean_points). None: not reported.
    step_seconds_by_requests: StepTimes | None = None
    step_seconds_by_tokens: StepTimes | None = None
    kv_transport: str | None = None  # its KV transport's name (tcp, nixl, ...)
    kv_fabric: str | None = None  # the wire that KV crosses between hosts: tcp, rdma, host, nccl (kv_transfer/fabric.py)
    kv_tiers: KVTierStats | None = None  # only with KV offload tiers
    lora_adapters: list[str] | None = None  # the LoRA adapters it holds read (names); only with enable_lora

    # A decode worker's (None on a prefill worker).
    waiting_for_kv: Count | None = None  # requests whose prompt KV a prefill worker computes
    quarantined_blocks: Count | None = None  # held out of use until a given-up write is confirmed (fence)
    remote: Count | None = None  # requests prefilled on a prefill worker (total)
    local: Count | None = None  # requests prefilled here (total)
    fallbacks: Count | None = None  # remote prefills that fell back to local (total)
    fenced_refusals: Count | None = None  # prompts kept from a prefill worker whose fences hold too much (total)
    saturated: Count | None = None  # remote prefills kept local: every prefill worker at its limit (total)
    kv_bytes_received: Count | None = None  # total
    kv_transfer_seconds: float | None = None  # prefill workers' KV computed -> last write acknowledged (total)
    kv_transfer_failures: Count | None = None  # remote prefills that failed (total)
    late_writes_dropped: Count | None = None  # KV writes refused as late or unreserved (total)
    kv_overwritten: Count | None = None  # writes for a given-up reservation that landed, in fenced blocks (total)
    kv_overwritten_in_use: Count | None = None  # writes that landed in released blocks: 0 expected (total)
    spec_decode: SpecDecodeStats | None = None  # only while it speculates

    # A prefill worker's (None on a decode worker).
    jobs: Count | None = None  # remote prefills in flight
    prefills: Count | None = None  # remote prefills whose KV was all written (total)
    blocks_written: Count | None = None  # KV blocks written to decode workers (total)
    failed: Count | None = None  # remote prefills that failed here (total)
    refused: Count | None = None  # remote prefills refused unstarted: past their deadline, or no peer's (total)
    tokens_computed: Count | None = None  # prompt tokens computed (total)

    @property
    def kv_used(self) -> float:
        """The fraction of its KV blocks in use (not free)."""
        return 1 - self.free_blocks / self.num_blocks if self.num_blocks else 0.0
