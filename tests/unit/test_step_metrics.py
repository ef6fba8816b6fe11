"""A worker's step histograms (workers/step_metrics.py): buckets, the wire form, which
steps count, and the quantile `pdserve status` prints from them."""

from __future__ import annotations

import msgspec
import pytest

from engine.engine_core import StepOutput
from protocol import Histogram
from workers.step_metrics import FixedHistogram, StepMetrics, histogram_quantile


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
