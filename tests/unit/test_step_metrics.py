"""A worker's step histograms and step times by size (workers/step_metrics.py): buckets,
the wire form, which steps count, the quantile `pdserve status` prints from them, and the
mean points the router's latency predictor reads."""

from __future__ import annotations

import msgspec
import pytest

from engine.engine_core import StepOutput
from protocol import Histogram, StepTimes, mean_points
from workers.step_metrics import (
    STEP_REQUESTS_BUCKETS,
    STEP_TOKENS_BUCKETS,
    FixedHistogram,
    FixedStepTimes,
    StepMetrics,
    histogram_quantile,
)


def test_values_fall_in_prometheus_buckets_and_the_snapshot_is_a_copy() -> None:
    h = FixedHistogram((1, 2, 4))
    for value in (0.5, 1, 1.5, 4, 9):  # a value equal to a bound is in that bound's bucket (le)
        h.observe(value)
    snap = h.snapshot()
    assert snap == Histogram(bounds=[1.0, 2.0, 4.0], counts=[2, 1, 1, 1], sum=16.0, count=5)
    h.observe(3)
    assert snap.counts == [2, 1, 1, 1] and snap.count == 5
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(snap), type=Histogram) == snap  # it goes in a StatsReply


@pytest.mark.parametrize("bounds", [(), (1, 1), (2, 1)])
def test_bounds_must_increase(bounds: tuple) -> None:
    with pytest.raises(ValueError, match="increasing"):
        FixedHistogram(bounds)


class FakeEngine:
    def __init__(self, outputs: list[StepOutput]) -> None:
        self.outputs = outputs

    def step(self) -> StepOutput:
        return self.outputs.pop(0)


def test_only_steps_that_computed_tokens_are_counted() -> None:
    metrics = StepMetrics()
    engine = FakeEngine([StepOutput(num_tokens=0), StepOutput(num_tokens=40, num_requests=3),
                         StepOutput(num_tokens=2, num_requests=2)])
    outs = [metrics.step(engine) for _ in range(3)]
    assert [o.num_tokens for o in outs] == [0, 40, 2]  # passed through unchanged
    seconds, requests, tokens = metrics.seconds.snapshot(), metrics.requests.snapshot(), metrics.tokens.snapshot()
    assert seconds.count == 2 and seconds.sum >= 0
    assert requests.sum == 5 and requests.count == 2
    assert tokens.sum == 42
    assert requests.counts[requests.bounds.index(2)] == 1  # 2 requests: le=2
    assert requests.counts[requests.bounds.index(4)] == 1  # 3 requests: le=4


def test_quantile_interpolates_within_a_bucket_as_prometheus_does() -> None:
    h = FixedHistogram((0.01, 0.02, 0.04))
    for value in (0.005, 0.015, 0.015, 0.03):
        h.observe(value)
    snap = h.snapshot()
    # rank 2 of 4 is the first of the two in (0.01, 0.02]: halfway through that bucket.
    assert histogram_quantile(snap, 0.5) == pytest.approx(0.015)
    assert histogram_quantile(snap, 0.25) == pytest.approx(0.01)  # the first bucket starts at 0
    assert histogram_quantile(snap, 1.0) == pytest.approx(0.04)
    h.observe(100)  # past the last bound: the last bound, as Prometheus says
    assert histogram_quantile(h.snapshot(), 1.0) == pytest.approx(0.04)
    assert histogram_quantile(FixedHistogram((1,)).snapshot(), 0.5) is None


def test_step_times_sum_sizes_and_seconds_per_size_bucket_and_give_mean_points() -> None:
    t = FixedStepTimes((1, 4, 16))
    for size, seconds in ((1, 0.01), (3, 0.02), (4, 0.04), (100, 0.5)):  # a size equal to a bound: that bucket
        t.observe(size, seconds)
    snap = t.snapshot()
    assert snap.counts == [1, 2, 0, 1] and snap.sizes == [1.0, 7.0, 0.0, 100.0]
    assert snap.seconds == pytest.approx([0.01, 0.06, 0.0, 0.5])
    t.observe(2, 1.0)
    assert snap.counts == [1, 2, 0, 1]  # a copy
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(snap), type=StepTimes) == snap  # it goes in a StatsReply
    # The empty bucket (4, 16] has no point; the others in size order, each its mean.
    assert mean_points(snap) == [(1.0, pytest.approx(0.01)), (3.5, pytest.approx(0.03)), (100.0, pytest.approx(0.5))]


@pytest.mark.parametrize("fields,message", [
    (dict(bounds=[]), "bounds must be a non-empty increasing"),
    (dict(bounds=[2.0, 1.0]), "bounds must be a non-empty increasing"),
    (dict(bounds=[1.0, float("inf")]), "bounds must be a non-empty increasing"),
    (dict(counts=[1, 1]), "counts must be 3"),
    (dict(sizes=[1.0]), "sizes must be 3"),
    (dict(seconds=[0.1, 0.2, 0.3, 0.4]), "seconds must be 3"),
    (dict(sizes=[1.0, -2.0, 0.0]), "sizes must be finite sums >= 0"),
    (dict(seconds=[0.1, float("nan"), 0.0]), "seconds must be finite sums >= 0"),
    (dict(seconds=[0.1, float("inf"), 0.0]), "seconds must be finite sums >= 0"),
])
def test_step_times_are_refused_when_they_do_not_add_up(fields: dict, message: str) -> None:
    good = dict(bounds=[1.0, 4.0], counts=[1, 1, 0], sizes=[1.0, 3.0, 0.0], seconds=[0.1, 0.2, 0.0])
    with pytest.raises(ValueError, match=message):
        StepTimes(**{**good, **fields})
    # Decoded from a peer: the same check, as a ValidationError naming the problem.
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.msgpack.decode(msgspec.msgpack.encode({**good, **fields}), type=StepTimes)


def test_step_metrics_keep_step_time_by_requests_and_by_tokens_per_step() -> None:
    metrics = StepMetrics()
    metrics.observe(0.02, requests=3, tokens=40)
    metrics.observe(0.04, requests=4, tokens=60)
    metrics.observe(0.5, requests=1, tokens=2000)
    by_requests, by_tokens = metrics.by_requests.snapshot(), metrics.by_tokens.snapshot()
    assert by_requests.bounds == [float(b) for b in STEP_REQUESTS_BUCKETS]
    assert by_tokens.bounds == [float(b) for b in STEP_TOKENS_BUCKETS]
    assert mean_points(by_requests) == [(1.0, pytest.approx(0.5)), (3.5, pytest.approx(0.03))]  # 3 and 4: (2, 4]
    assert mean_points(by_tokens) == [(50.0, pytest.approx(0.03)), (2000.0, pytest.approx(0.5))]  # (16, 64], (1024, 4096]
