"""The router's view of worker figures (router/metrics.py, router/worker_metrics.py):
step histograms become Prometheus histograms and stats become gauges, each labelled
by worker and role; a malformed histogram never gets past decoding; TPOT."""

from __future__ import annotations

from pathlib import Path

import msgpack
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protocol import PROTOCOL_VERSION, WORKER_MESSAGES, MessageError, StatsReply, WorkerStats, encode
from router.metrics import WORKER_GAUGES, RouterMetrics
from router.worker_metrics import STEP_HISTOGRAMS
from tests.worker_stats import worker_stats
from workers.step_metrics import StepMetrics


def samples(metrics: RouterMetrics) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from the rendered exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def with_steps(steps: StepMetrics, **figures: float) -> WorkerStats:
    return worker_stats(step_seconds=steps.seconds.snapshot(), step_requests=steps.requests.snapshot(),
                        step_tokens=steps.tokens.snapshot(), **figures)


def stats_with_steps(*steps: tuple[float, int, int], **figures: float) -> WorkerStats:
    steps_metrics = StepMetrics()
    for step in steps:
        steps_metrics.observe(*step)
    return with_steps(steps_metrics, **figures)


def test_step_histograms_and_gauges_are_labelled_by_worker_and_role() -> None:
    m = RouterMetrics()
    m.set_worker("decode-0", "decode", stats_with_steps((0.003, 4, 4), (0.03, 2, 40), running=2, preemptions=1,
                                                        num_blocks=80, free_blocks=70))
    m.set_worker("prefill-0", "prefill", stats_with_steps((0.2, 1, 512), jobs=1, tokens_computed=512,
                                                          blocks_written=32, prefills=3, failed=1, refused=2,
                                                          kv_transport="nixl", kv_fabric="tcp"))
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
    link = (("fabric", "tcp"), ("role", "prefill"), ("transport", "nixl"), ("worker", "prefill-0"))
    assert got[("pdserve_worker_prefill_blocks_written", link)] == 32  # a transfer figure: which wire it crossed
    assert got[("pdserve_worker_prefills_done", p)] == 3 and got[("pdserve_worker_prefills_failed", p)] == 1
    assert got[("pdserve_worker_prefills_refused", p)] == 2
    assert ("pdserve_worker_prefill_jobs", d) not in got  # a worker reports its role's figures only


def test_transfer_gauges_follow_a_worker_onto_another_fabric_and_leave_with_it() -> None:
    m = RouterMetrics()
    m.set_worker("decode-0", "decode", worker_stats(kv_bytes_received=10, kv_transport="nixl", kv_fabric="rdma"))
    m.set_worker("decode-0", "decode", worker_stats(kv_bytes_received=20, kv_transport="nixl", kv_fabric="tcp"))
    received = {labels: v for (name, labels), v in samples(m).items() if name == "pdserve_worker_kv_bytes_received"}
    assert received == {(("fabric", "tcp"), ("role", "decode"), ("transport", "nixl"), ("worker", "decode-0")): 20}
    m.forget_worker("decode-0", "decode")
    assert not [name for name, _ in samples(m) if name.startswith("pdserve_worker_") and "decode-0" in str(_)]


def test_a_later_reply_replaces_the_histogram_it_is_cumulative_on_the_worker() -> None:
    m, steps = RouterMetrics(), StepMetrics()
    steps.observe(0.01, 1, 1)
    m.set_worker("decode-0", "decode", with_steps(steps))
    steps.observe(0.01, 1, 1)
    m.set_worker("decode-0", "decode", with_steps(steps))
    assert samples(m)[("pdserve_worker_step_seconds_count", (("role", "decode"), ("worker", "decode-0")))] == 2


def test_worker_live_is_labelled_by_role() -> None:
    m = RouterMetrics()
    m.set_live({"decode-0": True}, {"prefill-0": False})
    got = samples(m)
    assert got[("pdserve_worker_live", (("role", "decode"), ("worker", "decode-0")))] == 1
    assert got[("pdserve_worker_live", (("role", "prefill"), ("worker", "prefill-0")))] == 0
    assert got[("pdserve_decode_workers_live", ())] == 1 and got[("pdserve_prefill_workers_live", ())] == 0


def test_every_gauge_and_histogram_is_a_worker_stats_field() -> None:
    fields = {f.name: f.type for f in msgspec.structs.fields(WorkerStats)}
    assert set(WORKER_GAUGES) <= set(fields) and set(STEP_HISTOGRAMS) <= set(fields)


@pytest.mark.parametrize("hist, message", [
    ([1, 2], "Expected `object`, got `array` - at `$.stats.step_tokens`"),
    ({"bounds": [2, 1], "counts": [0, 0, 0], "sum": 0, "count": 0}, "increasing"),
    ({"bounds": [1], "counts": [0], "sum": 0, "count": 0}, "counts must be 2"),
    ({"bounds": [1], "counts": [0, -1], "sum": 0, "count": 0}, "Expected `int` >= 0"),
    ({"bounds": [1], "counts": [0, 1], "sum": "x", "count": 1}, "Expected `float`, got `str`"),
])
def test_a_malformed_histogram_is_refused_with_its_reply_naming_the_field(hist, message: str) -> None:
    """A worker that sends one is broken: the reply is dropped (the router logs it, and
    the worker reads as not answering), never a failed scrape."""
    reply = msgspec.to_builtins(StatsReply(seq=1, stats=worker_stats()))
    reply["stats"]["step_tokens"] = hist
    with pytest.raises(MessageError, match="stats_reply") as refused:
        WORKER_MESSAGES.decode(msgpack.packb(reply))
    assert message in str(refused.value) and "step_tokens" in str(refused.value)
    assert reply["v"] == PROTOCOL_VERSION and WORKER_MESSAGES.decode(encode(StatsReply(seq=1, stats=worker_stats())))


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


def test_kv_tier_figures_are_labelled_by_worker_role_and_tier_and_leave_with_the_worker() -> None:
    from protocol import KVTierStats, TierUsage

    tiers = KVTierStats(tiers=[TierUsage(name="host", capacity_blocks=100, used_blocks=40, hits=7),
                               TierUsage(name="disk", capacity_blocks=1000, used_blocks=90, hits=2)],
                        offloaded_bytes=4096, loaded_bytes=2048, loads=3, load_seconds=0.25, failed_loads=1,
                        dropped_blocks=5)
    m = RouterMetrics()
    m.set_worker("decode-0", "decode", stats_with_steps(kv_tiers=tiers))
    m.set_worker("decode-1", "decode", stats_with_steps())  # no tiers: no samples
    got = samples(m)
    d = (("role", "decode"), ("worker", "decode-0"))
    assert got[("pdserve_kv_tier_used_blocks", (d[0], ("tier", "host"), d[1]))] == 40
    assert got[("pdserve_kv_tier_capacity_blocks", (d[0], ("tier", "disk"), d[1]))] == 1000
    assert got[("pdserve_kv_tier_hits_blocks_total", (d[0], ("tier", "disk"), d[1]))] == 2
    assert got[("pdserve_kv_offloaded_bytes_total", d)] == 4096
    assert got[("pdserve_kv_tier_load_seconds_total", d)] == 0.25
    assert got[("pdserve_kv_tier_failed_loads_total", d)] == 1
    assert not any(("worker", "decode-1") in labels for name, labels in got if name.startswith("pdserve_kv_"))
    m.forget_worker("decode-0", "decode")
    assert not any(name.startswith("pdserve_kv_") for name, _ in samples(m))
