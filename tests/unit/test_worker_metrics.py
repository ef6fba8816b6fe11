"""The router's view of worker figures (router/metrics.py, router/worker_metrics.py):
step histograms become Prometheus histograms and stats become gauges, each labelled
by worker and role; a malformed histogram is left out, never a failed scrape; TPOT."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import RouterMetrics
from router.worker_metrics import prometheus_buckets
from workers.step_metrics import StepMetrics


def samples(metrics: RouterMetrics) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from the rendered exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def stats_with_steps(*steps: tuple[float, int, int], **figures: float) -> dict:
    steps_metrics = StepMetrics()
    for step in steps:
        steps_metrics.observe(*step)
    return {**figures, **steps_metrics.stats()}


def test_step_histograms_and_gauges_are_labelled_by_worker_and_role() -> None:
    m = RouterMetrics()
    m.set_worker("decode-0", "decode", stats_with_steps((0.003, 4, 4), (0.03, 2, 40), running=2, preemptions=1,
                                                        num_blocks=80, free_blocks=70))
    m.set_worker("prefill-0", "prefill", stats_with_steps((0.2, 1, 512), jobs=1, tokens_computed=512,
                                                          blocks_written=32, prefills=3, failed=1))
    got = samples(m)
    d, p = (("role", "decode"), ("worker", "decode-0")), (("role", "prefill"), ("worker", "prefill-0"))
    assert got[("pdserve_worker_step_seconds_count", d)] == 2
    assert got[("pdserve_worker_step_seconds_sum", d)] == pytest.approx(0.033)
    # cumulative, as Prometheus buckets are: 0.003 is in le=0.005, 0.03 in le=0.04
    assert got[("pdserve_worker_step_seconds_bucket", (("le", "0.0025"), *d))] == 0
    assert got[("pdserve_worker_step_seconds_bucket", (("le", "0.005"), *d))] == 1
    assert got[("pdserve_worker_step_seconds_bucket", (("le", "0.04"), *d))] == 2
    assert got[("pdserve_worker_step_seconds_bucket", (("le", "+Inf"), *d))] == 2
    assert got[("pdserve_worker_step_requests_sum", d)] == 6
    assert got[("pdserve_worker_step_tokens_sum", p)] == 512
    assert got[("pdserve_worker_step_seconds_count", p)] == 1
    assert got[("pdserve_worker_running", d)] == 2 and got[("pdserve_worker_preemptions", d)] == 1
    assert got[("pdserve_worker_free_blocks", d)] == 70
    assert got[("pdserve_worker_prefill_jobs", p)] == 1
    assert got[("pdserve_worker_prefill_tokens_computed", p)] == 512
    assert got[("pdserve_worker_prefill_blocks_written", p)] == 32
    assert got[("pdserve_worker_prefills_done", p)] == 3 and got[("pdserve_worker_prefills_failed", p)] == 1
    assert ("pdserve_worker_prefill_jobs", d) not in got  # a worker reports its role's figures only


def test_a_later_reply_replaces_the_histogram_it_is_cumulative_on_the_worker() -> None:
    m, steps = RouterMetrics(), StepMetrics()
    steps.observe(0.01, 1, 1)
    m.set_worker("decode-0", "decode", steps.stats())
    steps.observe(0.01, 1, 1)
    m.set_worker("decode-0", "decode", steps.stats())
    assert samples(m)[("pdserve_worker_step_seconds_count", (("role", "decode"), ("worker", "decode-0")))] == 2


def test_worker_live_is_labelled_by_role() -> None:
    m = RouterMetrics()
    m.set_live({"decode-0": True}, {"prefill-0": False})
    got = samples(m)
    assert got[("pdserve_worker_live", (("role", "decode"), ("worker", "decode-0")))] == 1
    assert got[("pdserve_worker_live", (("role", "prefill"), ("worker", "prefill-0")))] == 0
    assert got[("pdserve_decode_workers_live", ())] == 1 and got[("pdserve_prefill_workers_live", ())] == 0


@pytest.mark.parametrize("hist, message", [
    ([1, 2], "a map"),
    ({"bounds": [2, 1], "counts": [0, 0, 0], "sum": 0}, "increasing"),
    ({"bounds": [1], "counts": [0], "sum": 0}, "2 counts"),
    ({"bounds": [1], "counts": [0, -1], "sum": 0}, "2 counts"),
    ({"bounds": [1], "counts": [0, 1], "sum": "x"}, "sum must be a number"),
])
def test_a_malformed_histogram_is_named_and_left_out(hist, message: str, caplog) -> None:
    with pytest.raises(ValueError, match=message):
        prometheus_buckets(hist)
    m = RouterMetrics()
    good = StepMetrics()
    good.observe(0.01, 1, 1)
    with caplog.at_level(logging.WARNING):
        m.set_worker("decode-0", "decode", {**good.stats(), "step_tokens": hist, "running": 1})
    got = samples(m)
    labels = (("role", "decode"), ("worker", "decode-0"))
    assert ("pdserve_worker_step_tokens_count", labels) not in got
    assert got[("pdserve_worker_step_seconds_count", labels)] == 1 and got[("pdserve_worker_running", labels)] == 1
    assert "decode-0 sent a malformed step_tokens histogram" in caplog.text


def test_tpot_is_the_decode_time_per_token_after_the_first() -> None:
    m = RouterMetrics()
    m.observe_tpot(e2e=1.0, ttft=0.4, num_tokens=4)  # 0.6 s over 3 tokens
    m.observe_tpot(e2e=1.0, ttft=1.0, num_tokens=1)  # one token: no TPOT
    got = samples(m)
    assert got[("pdserve_time_per_output_token_seconds_count", ())] == 1
    assert got[("pdserve_time_per_output_token_seconds_sum", ())] == pytest.approx(0.2)


def test_docs_api_lists_every_metric_the_router_exports() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    families = list(RouterMetrics().registry.collect())
    undocumented = [f.name for f in families if f"`{f.name}`" not in doc and f"`{f.name}_total`" not in doc]
    assert families and undocumented == []
