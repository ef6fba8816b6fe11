"""SLO-aware admission's pure parts: where a request's targets come from, the fair
queue's tags, the latency predictor's arithmetic and learning, and the admission
decision (router/slo.py, fair_queue.py, predictor.py, admission.py)."""

from __future__ import annotations

import math
import time

import pytest

from cluster.config import ClusterConfig
from cluster.config_fields import ConfigError
from protocol import StepTimes
from router.admission import LOWEST_PRIORITY, Candidate, decide
from router.errors import APIError
from router.fair_queue import FairQueue
from router.predictor import HALF_LIFE_S, LatencyPredictor, Prediction, Ticket, prefill_rate, step_seconds
from router.slo import Targets, body_targets, header_targets, resolve
from tests.worker_stats import worker_stats


def step_times(points: list[tuple[float, float]], bounds: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256,
                                                                              512, 1024, 4096)) -> StepTimes:
    """One step of each (size, seconds), in the bucket its size falls in."""
    counts, sizes, seconds = [0] * (len(bounds) + 1), [0.0] * (len(bounds) + 1), [0.0] * (len(bounds) + 1)
    for size, sec in points:
        i = next((i for i, b in enumerate(bounds) if size <= b), len(bounds))
        counts[i] += 1
        sizes[i] += size
        seconds[i] += sec
    return StepTimes(bounds=[float(b) for b in bounds], counts=counts, sizes=sizes, seconds=seconds)


# --- targets -------------------------------------------------------------------------


class Settings:
    policy = "reject"
    ttft_ms: float | None = 2000.0
    tpot_ms: float | None = None
    key_defaults = (Targets(500.0, 50.0), None)


def test_each_target_comes_from_the_first_source_that_sets_it() -> None:
    body, headers = Targets(ttft_ms=100.0), Targets(ttft_ms=300.0, tpot_ms=30.0)
    assert resolve(body, headers, 0, Settings()) == Targets(100.0, 30.0)
    assert resolve(Targets(), Targets(), 0, Settings()) == Targets(500.0, 50.0)  # the key's
    assert resolve(Targets(), Targets(), 1, Settings()) == Targets(2000.0, None)  # key 1 has none: the deployment's
    assert resolve(Targets(), Targets(), None, None) == Targets()


@pytest.mark.parametrize("value", [0, -5, "100", True, float("inf"), float("nan"), 1e12, 10**400, 5e-324, 0.0009])
def test_a_bad_body_target_is_a_400_naming_it(value: object) -> None:
    with pytest.raises(APIError) as exc:
        body_targets({"slo_tpot_ms": value})
    assert exc.value.status == 400 and exc.value.param == "slo_tpot_ms"


class Headers(dict):
    def getlist(self, key: str) -> list[str]:
        value = self.get(key)
        return [] if value is None else value if isinstance(value, list) else [value]


@pytest.mark.parametrize("value", ["fast", "1_000", "nan", "inf", "-5", "0x10", "5e-324", "", "1e400"])
def test_headers_carry_targets_and_a_bad_one_names_the_header(value: str) -> None:
    assert header_targets(Headers({"x-slo-ttft-ms": " 250 ", "x-slo-tpot-ms": ".5e2"})) == Targets(250.0, 50.0)
    with pytest.raises(APIError, match="header x-slo-tpot-ms must be a number") as exc:
        header_targets(Headers({"x-slo-tpot-ms": value}))
    assert exc.value.status == 400 and exc.value.param == "slo_tpot_ms"


def test_a_header_given_twice_is_refused() -> None:
    with pytest.raises(APIError, match="header x-slo-ttft-ms is given 2 times") as exc:
        header_targets(Headers({"x-slo-ttft-ms": ["100000", "abc"]}))
    assert exc.value.status == 400


def test_a_finished_request_meets_its_targets_only_within_both() -> None:
    t = Targets(ttft_ms=100.0, tpot_ms=20.0)
    assert t.met(0.09, 0.019) and t.met(0.1, None)
    assert not t.met(0.11, 0.01) and not t.met(0.05, 0.021)


# --- the config ----------------------------------------------------------------------


def config(router: dict) -> ClusterConfig:
    return ClusterConfig.from_dict({"model": "m", "prefill": {"replicas": 1}, "decode": {"replicas": 1},
                                    "router": router})


def test_the_slo_config_loads_per_key_defaults_and_weights() -> None:
    c = config({"api_keys": ["sk-a", "sk-b"], "key_weights": [1, 3],
                "slo": {"policy": "best_effort", "ttft_ms": 800, "key_defaults": [{"tpot_ms": 40}, None]}})
    assert c.router.key_weights == (1.0, 3.0)
    assert c.router.slo.policy == "best_effort" and c.router.slo.ttft_ms == 800.0
    assert c.router.slo.key_defaults == (Targets(None, 40.0), None)
    assert config({}).router.slo.policy == "off" and config({"slo": None}).router.slo.policy == "off"
    assert config({"slo": {"policy": False}}).router.slo.policy == "off"  # YAML's reading of a bare `off`


@pytest.mark.parametrize("router,message", [
    ({"slo": {"policy": "drop"}}, "router.slo.policy: must be one of"),
    ({"slo": {"ttft_ms": 0}}, "router.slo.ttft_ms: must be > 0"),
    ({"slo": {"key_defaults": [{"ttft_ms": 5}]}}, "router.slo.key_defaults: has 1 entries but router.api_keys lists 0"),
    ({"api_keys": ["sk-a"], "slo": {"key_defaults": [{"ttft": 5}]}}, r"router.slo.key_defaults\[0\].ttft: unknown key"),
    ({"api_keys": ["sk-a"], "slo": {"key_defaults": [{"tpot_ms": -1}]}}, r"router.slo.key_defaults\[0\].tpot_ms: must be > 0"),
    ({"key_weights": [1]}, "router.key_weights: needs router.api_keys"),
    ({"api_keys": ["sk-a", "sk-b"], "key_weights": [1]}, "router.key_weights: must be a list of 2 weight"),
    ({"api_keys": ["sk-a"], "key_weights": [0]}, r"router.key_weights\[0\]: must be > 0"),
    ({"api_keys": ["sk-a", "sk-b"], "key_weights": [2000, 1e-3]}, "router.key_weights: the largest weight must be "
                                                                  "at most 1e[+]06 times the smallest"),
    ({"api_keys": ["sk-a", "sk-b"], "key_weights": [1e-306, 1e-306]}, "router.key_weights: every weight must be at "
                                                                      "least 0.001"),
    ({"slo": {"ttft_ms": 10**400}}, "router.slo.ttft_ms: must be finite"),
])
def test_a_bad_slo_config_names_its_field(router: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config(router)


# --- fair queuing ----------------------------------------------------------------------


def test_a_flooding_key_queues_behind_a_quiet_ones_next_request() -> None:
    fq = FairQueue((1.0, 1.0))
    flood = [fq.tag(0, 100) for _ in range(20)]  # 20 requests of 100 tokens, none served yet
    assert flood == sorted(flood) and flood[-1] == 1900
    quiet = fq.tag(1, 100)
    assert quiet == 0.0 and quiet < flood[1]  # at the head: before every queued flood request but the first
    for tag in [*flood[:10], quiet]:  # the queues serve ten of them and the quiet one
        fq.done(tag)
    fq.done(flood[15])  # one aborted deep in the queue moves nothing
    assert fq.virtual_time() == 1000.0  # the head of the queue: the flood's 11th
    assert fq.tag(1, 100) == 1000.0  # there, not after its own share's end (100)
    assert fq.tag(0, 100) == 2000.0  # the flood's next stays behind its backlog


def test_served_out_of_tag_order_the_virtual_time_stays_at_the_head_of_what_waits() -> None:
    fq = FairQueue((1.0, 1.0))
    flood = [fq.tag(0, 100) for _ in range(10)]  # 0 .. 900
    fq.done(flood[0])  # one worker serves the head ...
    fq.done(flood[9])  # ... an idle one the tail
    assert fq.virtual_time() == 100.0  # not 900: eight of the flood's still wait from 100 on
    assert fq.tag(1, 100) == 100.0


def test_a_request_of_a_worse_priority_waiting_does_not_hold_back_the_virtual_time() -> None:
    fq = FairQueue((1.0, 1.0, 1.0))
    degraded = fq.tag(2, 10, lowest=True)  # waits at the lowest priority, long
    for _ in range(50):
        fq.done(fq.tag(0, 100))
    # Nothing but the degraded request waits: V is where every tag issued ends (the
    # flood's 50 of 100 after the degraded one's 10).
    assert degraded == 0.0 and fq.virtual_time() == 5010.0
    assert fq.tag(1, 100) == 5010.0  # a newly active key starts where service is, not at 0


def test_weights_share_the_queue_an_idle_queue_catches_up_and_a_refund_costs_nothing() -> None:
    fq = FairQueue((1.0, 4.0))
    assert [fq.tag(1, 400) for _ in range(3)] == [0.0, 100.0, 200.0]  # weight 4: a quarter of the cost
    a = fq.tag(0, 400)
    assert a == 0.0
    for tag in (0.0, 100.0, 200.0, 0.0):
        fq.done(tag)
    assert fq.virtual_time() == 400.0  # nothing waits: every tag issued has been served
    start = fq.start(1)
    assert start == 400.0
    fq.refund(fq.charge(1, start, 40))  # refused after all
    assert fq.start(1) == 400.0 and fq.virtual_time() == 400.0


def test_without_weights_every_tag_is_zero_and_arrival_order_holds() -> None:
    fq = FairQueue(None)
    assert not fq.enabled and fq.tag(0, 1000) == 0.0 and fq.tag(None, 5) == 0.0
    fq.done(0.0)  # a no-op


# --- the predictor ---------------------------------------------------------------------


def test_step_time_interpolates_between_batches_and_extrapolates_the_last_slope() -> None:
    t = step_times([(1, 0.010), (4, 0.016), (16, 0.040)])
    assert step_seconds(t, 1) == pytest.approx(0.010)
    assert step_seconds(t, 10) == pytest.approx(0.016 + 0.024 * 6 / 12)
    assert step_seconds(t, 28) == pytest.approx(0.040 + 0.002 * 12)
    assert step_seconds(None, 4) is None and step_seconds(step_times([]), 4) is None


def test_one_measured_batch_size_is_extrapolated_flat_and_equal_means_do_not_divide_by_zero() -> None:
    assert step_seconds(step_times([(1, 0.02)]), 8) == pytest.approx(0.02)
    twins = StepTimes(bounds=[1.0, 2.0], counts=[1, 1, 0], sizes=[1.0, 1.0, 0.0], seconds=[0.01, 0.03, 0.0])
    assert step_seconds(twins, 4) == pytest.approx(0.01)


def test_a_decode_worker_without_prefill_steps_borrows_the_prefill_pools_rate() -> None:
    p = LatencyPredictor()
    decode_only = step_times([(64, 0.05), (128, 0.08)])  # its prompts were all prefilled remotely
    p.update("decode", "d0", worker_stats(step_seconds_by_requests=step_times([(64, 0.05), (128, 0.08)]),
                                          step_seconds_by_tokens=decode_only))
    p.update("prefill", "p0", worker_stats(step_seconds_by_tokens=step_times([(1000, 0.25)])))
    local = p.predict("d0", 400, False, (0, 0.0), 1, ["p0"])
    assert local.ttft_s == pytest.approx(400 / 4000 + 0.05)  # not 400 / 1600 (its decode steps' rate)


def test_short_prompts_alone_still_give_a_prefill_rate() -> None:
    # No step of 256 tokens, no prefill pool (colocated, or every prompt local so far).
    p = LatencyPredictor()
    p.update("decode", "d0", worker_stats(step_seconds_by_requests=step_times([(1, 0.02)]),
                                          step_seconds_by_tokens=step_times([(1, 0.02), (40, 0.08)])))
    assert p.predict("d0", 40, False, (0, 0.0), 1, []).ttft_s == pytest.approx(0.08 + 0.02)
    assert p.predict("d0", 40, True, (0, 0.0), 1, ["p0"]).ttft_s == pytest.approx(0.08 + 0.02)


def test_a_worker_with_no_figures_yet_is_predicted_from_the_pools_others() -> None:
    p = predictor()
    p.update("decode", "d1", worker_stats())  # just started: no step yet
    p.track(Ticket("d1", False, (0, 0.0), 500, 1, 0.0))
    fresh = p.predict("d1", 100, False, (0, 1.0), 1, [])
    assert fresh.ttft_s == pytest.approx(600 / 1000 + 0.03)  # d0's figures, d1's own queue


def test_the_prefill_rate_comes_from_a_workers_largest_steps() -> None:
    # Decode steps (few tokens each) would drag a plain mean down; only the large ones count.
    t = step_times([(8, 0.02), (8, 0.02), (1000, 0.5), (800, 0.4)])
    assert prefill_rate(t) == pytest.approx(1800 / 0.9)
    assert prefill_rate(None) is None


def predictor(decode_rate: float = 1000.0, step_s: float = 0.02, prefill: float | None = 4000.0) -> LatencyPredictor:
    p = LatencyPredictor()
    p.update("decode", "d0", worker_stats(step_seconds_by_requests=step_times([(1, step_s), (2, step_s * 1.5)]),
                                          step_seconds_by_tokens=step_times([(1000, 1000 / decode_rate)])))
    if prefill is not None:
        p.update("prefill", "p0", worker_stats(step_seconds_by_tokens=step_times([(1000, 1000 / prefill)])))
    return p


def test_ttft_counts_what_is_queued_ahead_in_the_queues_order() -> None:
    p = predictor()
    alone = p.predict("d0", 100, False, (0, 0.0), 1, ["p0"])
    assert alone.ttft_s == pytest.approx(100 / 1000 + 0.02)  # its prefill + one step at batch 1
    p.track(Ticket("d0", False, (0, 5.0), 500, 1, 0.0))  # a batch of 2 from now on
    behind = p.predict("d0", 100, False, (0, 9.0), 1, ["p0"])
    ahead = p.predict("d0", 100, False, (0, 1.0), 1, ["p0"])  # a lower tag: served first
    urgent = p.predict("d0", 100, False, (-1, 9.0), 1, ["p0"])  # a better priority: served first
    assert behind.ttft_s == pytest.approx(600 / 1000 + 0.02 * 1.5)
    assert ahead.ttft_s == urgent.ttft_s == pytest.approx(100 / 1000 + 0.02 * 1.5)
    remote = p.predict("d0", 100, True, (0, 9.0), 1, ["p0"])  # the local ticket does not queue on the prefill pool
    assert remote.ttft_s == pytest.approx(100 / 4000 + 0.02 * 1.5)
    # No prefill worker has reported yet: the decode worker's own rate stands in.
    assert p.predict("d0", 100, True, (0, 9.0), 1, []).ttft_s == pytest.approx(100 / 1000 + 0.02 * 1.5)


def test_the_predictor_learns_from_completions_and_reports_its_error() -> None:
    errors: list[tuple[str, bool, float]] = []
    p = predictor()
    p.on_error = lambda *e: errors.append(e)
    for i in range(30):  # the worker is twice as slow as its figures say
        pred = p.predict("d0", 100, False, (0, float(i)), 1, [])
        now = time.monotonic()
        t = Ticket("d0", False, (0, float(i)), 100, 1, now - 2 * pred.raw_ttft, pred.ttft_s, pred.tpot_s,
                   pred.raw_ttft, pred.raw_tpot)
        p.track(t)
        p.first_token(t, now=now)
        p.ended(t, 2 * pred.raw_tpot)
    last = p.predict("d0", 100, False, (0, 99.0), 1, [])
    assert last.ttft_s == pytest.approx(2 * last.raw_ttft, rel=0.01)
    assert last.tpot_s == pytest.approx(2 * last.raw_tpot, rel=0.01)
    assert not p.tickets  # every ticket ended
    q = p.error_quantiles()
    assert q["ttft"]["n"] == 30 and q["ttft"]["p50_s"] < 0.01  # learnt within a few requests
    assert errors[0][:2] == ("ttft", False) and errors[0][2] == pytest.approx(0.12)


def test_a_correction_fades_back_to_the_figures_without_completions() -> None:
    p = predictor()
    pred = p.predict("d0", 100, False, (0, 0.0), 1, [])
    start = time.monotonic()
    t = Ticket("d0", False, (0, 0.0), 100, 1, start - 4 * pred.raw_ttft, pred.ttft_s, pred.tpot_s, pred.raw_ttft,
               pred.raw_tpot)
    p.track(t)
    p.first_token(t, now=start)  # a busy moment: 4x the figures
    correction = p._ttft[("d0", False)]
    assert correction.factor(start) == pytest.approx(4.0)
    assert correction.factor(start + HALF_LIFE_S) == pytest.approx(2.0)  # half the log: sqrt(4)
    assert correction.factor(start + 10 * HALF_LIFE_S) == pytest.approx(1.0, rel=0.01)


def test_transfer_seconds_per_token_are_learnt_from_remote_prefills() -> None:
    p = predictor()
    for bad in (float("inf"), float("nan"), -1.0):  # a faulty worker's figure teaches nothing
        p.transfer(bad, 500)
    assert p.transfer_s_per_token is None
    p.transfer(0.05, 500)  # 100 us per token
    pred = p.predict("d0", 1000, True, (0, 0.0), 1, ["p0"])
    assert pred.ttft_s == pytest.approx(1000 / 4000 + 0.1 + 0.02)


# --- the decision ------------------------------------------------------------------------


def candidate(name: str, ttft: float | None, tpot: float | None = 0.01) -> Candidate:
    return Candidate(name, 0, False, Prediction(ttft, tpot, ttft, tpot))


def counted() -> tuple[list[tuple[str, str]], object]:
    seen: list[tuple[str, str]] = []
    return seen, lambda decision, reason: seen.append((decision, reason))


def test_the_feasible_candidate_with_the_most_headroom_wins_and_the_policy_order_breaks_ties() -> None:
    seen, count = counted()
    targets = Targets(ttft_ms=1000.0)
    picks = decide([candidate("a", 0.8), candidate("b", 0.2), candidate("c", 0.21)], targets, "reject", 0.0, count)
    assert picks.candidate.worker == "b" and not picks.degraded and seen == [("admitted", "met")]
    tie = decide([candidate("a", 0.30), candidate("b", 0.29)], targets, "reject", 0.0)
    assert tie.candidate.worker == "a"  # within one headroom step: the routing policy's first choice
    late = decide([candidate("a", 0.3)], targets, "reject", 0.65)  # time already spent counts
    assert late.candidate.worker == "a"
    with pytest.raises(APIError):
        decide([candidate("a", 0.3)], targets, "reject", 0.75)


def test_reject_is_a_429_naming_the_target_with_a_retry_after_from_the_prediction() -> None:
    seen, count = counted()
    with pytest.raises(APIError) as exc:
        decide([candidate("a", 3.4), candidate("b", 5.0)], Targets(ttft_ms=1000.0), "reject", 0.0, count)
    e = exc.value
    assert (e.status, e.param, e.code, e.kind) == (429, "slo_ttft_ms", "slo_unattainable", "rate_limit_error")
    assert e.retry_after == 3 and "slo_ttft_ms 1000" in e.message and "3400 ms" in e.message
    assert seen == [("rejected", "ttft")]
    with pytest.raises(APIError) as exc:
        decide([candidate("a", 0.1, 0.2)], Targets(tpot_ms=50.0), "reject", 0.0)
    assert exc.value.param == "slo_tpot_ms" and "200 ms apart" in exc.value.message


def test_best_effort_degrades_off_admits_and_unknown_figures_are_feasible() -> None:
    seen, count = counted()
    targets = Targets(ttft_ms=100.0, tpot_ms=10.0)
    slow = [candidate("a", 1.0, 0.5), candidate("b", 2.0, 0.5)]
    degraded = decide(slow, targets, "best_effort", 0.0, count)
    assert degraded.degraded and degraded.candidate.worker == "a" and degraded.reason == "ttft_tpot"
    assert not decide(slow, targets, "off", 0.0, count).degraded
    unknown = decide([candidate("a", 1.0), candidate("new", None, None)], targets, "reject", 0.0, count)
    assert unknown.candidate.worker == "new"
    assert not decide(slow, Targets(), "reject", 0.0, count).degraded  # no targets: nothing to miss
    assert seen == [("degraded", "ttft_tpot"), ("admitted", "off"), ("admitted", "unknown"), ("admitted", "no_slo")]
    assert LOWEST_PRIORITY == 2**63 - 1 and math.isfinite(float(LOWEST_PRIORITY))


# --- what a request's sequences report ----------------------------------------------------


def test_a_remote_requests_kv_hop_is_its_kv_write_phase_not_its_transfer_phase(llama_dir) -> None:
    """The transfer phase holds the prefill worker's wait for the step it was in
    (queueing, which the predictor counts as work ahead); kv_write is the hop itself."""
    import asyncio

    from engine.sampling_params import SamplingParams
    from engine.tokenizer import load_tokenizer
    from protocol import Tokens
    from router.metrics import RouterMetrics
    from router.sequences import SequenceGroup

    seen: list[tuple[float | None, float | None]] = []

    class Tracker:
        def first_token(self, ticket: Ticket) -> None:
            pass

        def ended(self, ticket: Ticket, tpot_s: float | None, transfer_s: float | None) -> None:
            seen.append((tpot_s, transfer_s))

    class Worker:
        name = "d0"

        def subscribe(self, *a: object, **k: object) -> None:
            pass

        def unsubscribe(self, *a: object) -> None:
            pass

        def send(self, *a: object) -> bool:
            return True

    ticket = Ticket("d0", True, (0, 0.0), 100, 1, 0.0)
    group = SequenceGroup([[5, 6, 7]], SamplingParams(max_tokens=2), load_tokenizer(str(llama_dir)),
                          lambda *a: (Worker(), "r1", True, ticket), RouterMetrics(), Tracker())

    async def run() -> None:
        group.submit()
        group.inbox.put_nowait((group.seqs[0], "r1", Tokens(request_id="r1", tokens=[9], finished=False, reason="",
                                                             cached=0)))
        group.inbox.put_nowait((group.seqs[0], "r1", Tokens(
            request_id="r1", tokens=[9], finished=True, reason="length", cached=0, remote=True,
            phases={"queue": 0.0, "prefill": 0.3, "transfer": 2.5, "kv_write": 0.01, "decode": 0.1})))
        async for _ in group.chunks():
            pass

    asyncio.run(run())
    assert len(seen) == 1 and seen[0][1] == 0.01 and seen[0][0] is not None
