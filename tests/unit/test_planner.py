"""The P:D planner on synthetic load (tests/unit/planner_sim.py: pools of fixed
per-worker capacity whose latencies grow with utilisation), and the loop that runs it.
No process, no sleep but the loop thread's own few milliseconds."""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time

import pytest

from cluster.autoscale.config import AutoscaleConfig
from cluster.autoscale.forecast import Capacity, Trend
from cluster.autoscale.loop import PlannerLoop
from cluster.autoscale.planner import Decision, Planner
from cluster.autoscale.window import measure
from router.load import LoadSnapshot, WorkerLoad
from tests.unit.planner_sim import Load, Sim, Step, drive

# Targets on bucket bounds of router.metrics.LATENCY_BUCKETS, as a p90 read from the
# histogram is interpolated within its bucket: TPOT breaches past 0.25 s (the sim's
# decode utilisation > 0.8), TTFT past 2.5 s (prefill utilisation > 0.92).
CFG = {"enabled": True, "ttft_p90_s": 2.5, "tpot_p90_s": 0.25, "interval_s": 10, "window_s": 30,
       "scale_up_cooldown_s": 30, "scale_down_cooldown_s": 60, "prefill": {"min": 1, "max": 4},
       "decode": {"min": 1, "max": 4}}


def planner(**change: object) -> Planner:
    return Planner(AutoscaleConfig.from_dict({**CFG, **change}), base_min_tokens=64)


def ramp(start: float, end: float, seconds: float, steps: int = 10, **lengths: int) -> list[tuple[float, Load]]:
    return [(seconds / steps, Load(start + (end - start) * i / (steps - 1), **lengths)) for i in range(steps)]


def of(steps: list[Step], pool: str) -> list[Step]:
    return [s for s in steps if s.decision.pool == pool]


# Each rule alone: the others' thresholds set out of reach.
@pytest.mark.parametrize("change,reason", [
    ({}, "tpot_p90"),
    ({"tpot_p90_s": 60, "queue_high": 100}, "kv_usage"),  # KV past 85% at utilisation 1.06
    ({"tpot_p90_s": 60, "kv_usage_high": 1.0}, "decode_queue"),  # queue past 2 per worker at utilisation 1.25
])
def test_a_decode_heavy_ramp_adds_decode_workers(change: dict, reason: str) -> None:
    sim = Sim()
    steps = drive(planner(**change), sim, ramp(0.5, 3, 300) + [(120, Load(3))])
    assert steps and all(s.decision.pool == "decode" and s.decision.action == "up" for s in steps)
    assert steps[0].decision.reason == reason and {s.decision.reason for s in steps} <= {reason, "predicted_load"}
    assert sim.sizes == {"prefill": 1, "decode": 4}
    if not change:
        assert steps[0].figures["tpot"] > 0.25 and [s.decision.target for s in steps] == [2, 3, 4]
        assert sim.figures["tpot"] <= 0.25  # the SLO holds again at the peak


@pytest.mark.parametrize("change,reason", [
    ({"prefill_jobs_high": 100}, "ttft_p90"),
    ({"ttft_p90_s": 60}, "prefill_jobs"),  # jobs past 4 per worker at utilisation 1.125
])
def test_a_prefill_heavy_ramp_adds_prefill_workers(change: dict, reason: str) -> None:
    sim = Sim()
    steps = drive(planner(**change), sim, ramp(0.5, 3, 300, prompt_len=1000, output_len=4) + [(120, Load(3, 1000, 4))])
    assert steps and all(s.decision.pool == "prefill" and s.decision.action == "up" for s in steps)
    assert steps[0].decision.reason == reason and {s.decision.reason for s in steps} <= {reason, "predicted_load"}
    assert steps[0].figures["u_p"] > 0.92
    assert sim.sizes == {"prefill": 4, "decode": 1} and sim.figures["ttft"] <= 2.5


def test_prefill_short_at_its_max_raises_the_threshold_then_restores_it() -> None:
    sim = Sim(prefill=2, decode=2)
    steps = drive(planner(prefill={"min": 1, "max": 2}), sim, [(200, Load(6, 1000, 4)), (600, Load(0.5, 1000, 4))])
    router = [(s.decision.target, s.decision.reason) for s in of(steps, "router")]
    # At once to the median prompt (1000 tokens, read within its bucket: 896); then, with
    # prompts still coming, back one halving per down-cooldown.
    assert router == [(896, "prefill_bottleneck"), (448, "prefill_recovered"), (224, "prefill_recovered"),
                      (112, "prefill_recovered"), (64, "prefill_recovered")]
    assert not [s for s in steps if s.decision.action == "up"]  # prefill at its max; decode never short
    raised = of(steps, "router")[0]
    assert raised.figures["u_p"] > 0.92 and "with prefill at its max (2)" in raised.decision.detail
    # The threshold came back before prefill lost a worker.
    assert of(steps, "prefill")[0].at > of(steps, "router")[-1].at and sim.min_tokens == 64


def test_the_threshold_comes_back_before_prefill_loses_a_worker() -> None:
    sim = Sim(prefill=2, decode=1, min_tokens=256)  # raised while prefill was short; now idle
    steps = drive(planner(), sim, [(400, Load(0))])
    # Prefill computes nothing: the threshold comes back at once, not one halving per cooldown.
    assert [(s.decision.pool, s.decision.target) for s in steps] == [("router", 64), ("prefill", 1)]
    assert steps[1].at - steps[0].at >= 60  # prefill's calm clock starts once the threshold is back


def test_the_threshold_stops_at_min_tokens_max() -> None:
    sim = Sim(prefill=2, decode=4)
    steps = drive(planner(prefill={"min": 1, "max": 2}, min_tokens_max=100), sim, [(400, Load(20, 1000, 4))])
    assert [s.decision.target for s in of(steps, "router")] == [100]
    assert sim.figures["ttft"] > 2.5  # still short: no further step is possible


def test_idle_scales_both_pools_down_to_their_min_one_step_per_cooldown() -> None:
    sim = Sim(prefill=3, decode=3)
    steps = drive(planner(prefill={"min": 1, "max": 4}, decode={"min": 2, "max": 4}), sim, [(1200, Load(0))])
    assert {(s.decision.action, s.decision.reason) for s in steps} == {("down", "idle")}
    assert sim.sizes == {"prefill": 1, "decode": 2}
    for pool, sizes in (("prefill", [2, 1]), ("decode", [2])):
        assert [s.decision.target for s in of(steps, pool)] == sizes
    prefill = of(steps, "prefill")
    assert prefill[0].at - 1000 >= 60 and prefill[1].at - prefill[0].at >= 60


def test_a_busy_pool_is_not_scaled_down() -> None:
    sim = Sim(prefill=1, decode=3)  # decode utilisation 0.5: p90 TPOT within half its target, but KV 40% >= 30%
    assert drive(planner(), sim, [(600, Load(1.5, 100, 100))]) == []
    sim = Sim(prefill=1, decode=2)  # utilisation 0.75: KV under a raised kv_usage_low, but p90 TPOT > half its target
    assert drive(planner(kv_usage_low=0.9, kv_usage_high=0.95), sim, [(600, Load(1.5, 100, 100))]) == []
    sim = Sim(prefill=1, decode=5)  # utilisation 0.3, KV 24%: calm, so one goes; at 4 (KV 30%) it is not any more
    steps = drive(planner(), sim, [(600, Load(1.5, 100, 100))])
    assert [(s.decision.pool, s.decision.target, s.decision.reason) for s in steps] == [("decode", 4, "within_slo")]
    assert "decode KV usage 24%" in steps[0].decision.detail


def test_scale_up_waits_for_the_up_cooldown_per_pool() -> None:
    sim = Sim()
    steps = drive(planner(scale_up_cooldown_s=60, decode={"min": 1, "max": 8}, prefill={"min": 1, "max": 8}),
                  sim, [(400, Load(8, 1000, 100))])
    for pool in ("prefill", "decode"):
        times = [s.at for s in of(steps, pool)]
        assert len(times) >= 3 and all(b - a >= 60 for a, b in zip(times, times[1:]))
    # Separate clocks: decode's step does not hold prefill's back (both pools short at once).
    assert {s.decision.pool for s in steps if s.at == steps[0].at} == {"prefill", "decode"}


def test_the_first_decision_waits_one_window() -> None:
    sim = Sim()
    steps = drive(planner(), sim, [(100, Load(8))])
    assert steps[0].at == 1000 + 10 + 30  # first look at +10 s, then a full window


def test_no_decision_breaks_the_bounds() -> None:
    rng = random.Random(0)
    sim = Sim(prefill=2, decode=3)
    bounds = {"prefill": (1, 3), "decode": (2, 5)}
    p = planner(prefill={"min": 1, "max": 3}, decode={"min": 2, "max": 5}, scale_up_cooldown_s=0,
                scale_down_cooldown_s=10, min_tokens_max=512)
    seen = {pool: set() for pool in bounds}
    for _ in range(40):
        load = Load(rng.choice([0, 0, 0.5, 5, 20]), rng.choice([10, 1000, 4000]), rng.choice([2, 100, 400]))
        for step in drive(p, sim, [(rng.choice([30, 120]), load)]):
            d = step.decision
            if d.pool == "router":
                assert 64 <= d.target <= 512
            else:
                assert bounds[d.pool][0] <= d.target <= bounds[d.pool][1], d
            for pool in bounds:
                seen[pool].add(sim.sizes[pool])
    assert seen == {pool: set(range(low, high + 1)) for pool, (low, high) in bounds.items()}


def test_predicted_load_adds_workers_before_the_slo_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    phases = ramp(0.5, 3.5, 400, steps=40) + [(100, Load(3.5))]

    def run() -> tuple[list[Step], int]:
        sim, steps, breached = Sim(), [], 0
        p = planner()
        for phase in phases:  # one interval at a time: count the looks past the target
            for _ in range(round(phase[0] / 10)):
                steps += drive(p, sim, [(10, phase[1])])
                breached += sim.figures["tpot"] > 0.25
        return steps, breached

    predicted, breached = run()
    assert "predicted_load" in {s.decision.reason for s in predicted}
    assert all(s.figures["tpot"] <= 0.25 for s in predicted if s.decision.reason == "predicted_load")
    monkeypatch.setattr(Capacity, "learn", lambda *args: None)  # nothing learned: SLO rules alone
    reactive, breached_reactive = run()
    assert "predicted_load" not in {s.decision.reason for s in reactive}
    when = {s.decision.target: s.at for s in predicted}
    assert all(when[s.decision.target] <= s.at for s in reactive) and when[3] < of(reactive, "decode")[1].at
    assert breached < breached_reactive


def test_a_worker_that_did_not_answer_holds_scale_down() -> None:
    sim = Sim(prefill=2, decode=2, mute={"decode-1"})
    assert drive(planner(), sim, [(600, Load(0))]) == []


def test_a_size_changed_by_hand_restarts_the_pool_cooldown() -> None:
    sim = Sim(decode=1)
    p = planner(scale_up_cooldown_s=60, decode={"min": 1, "max": 8})
    drive(p, sim, [(30, Load(6))])  # the first window
    sim.decode = 2  # `pdserve scale` between two looks
    steps = drive(p, sim, [(100, Load(6))])
    assert of(steps, "decode")[0].at - 1000 >= 30 + 60


def test_without_a_prefill_pool_a_ttft_breach_is_decode_s() -> None:
    sim = Sim(prefill=0, decode=1)
    p = planner(prefill={"min": 0, "max": 0}, ttft_p90_s=0.01)  # any TTFT breaches; decode itself is calm
    steps = drive(p, sim, [(60, Load(0.2, 100, 10))])
    assert [(s.decision.pool, s.decision.reason) for s in steps] == [("decode", "ttft_p90")]


def test_trend_projects_along_its_last_windows() -> None:
    trend = Trend(points=3)
    assert trend.project(10) == 0.0
    trend.add(0, 100)
    assert trend.project(10) == 100
    for at, rate in ((10, 110), (20, 120), (30, 130)):
        trend.add(at, rate)
    trend.add(30, 999)  # the same window again: ignored
    assert trend.last == 130 and trend.project(25) == pytest.approx(155)
    trend.add(40, 0)
    assert trend.project(100) == 0.0  # never negative


def test_capacity_is_learned_from_busy_windows_and_lifted_by_calm_ones() -> None:
    cap = Capacity(samples=2)
    assert cap.workers_for(500) is None
    cap.learn(200, 2)
    cap.learn(300, 2)
    cap.learn(0, 2)  # nothing served says nothing about capacity
    assert cap.per_worker == 125 and cap.workers_for(0) == 0
    assert cap.workers_for(225) == 2 and cap.workers_for(226) == 3  # at 90% of 125/s per worker
    cap.lift(300, 3)  # 100/s per worker within targets: no news
    assert cap.per_worker == 125
    cap.lift(360, 3)  # 120/s per worker within targets: it can do at least 120 / 0.9
    assert cap.workers_for(360) == 3


def worker(name: str, role: str, **figures: float) -> WorkerLoad:
    return WorkerLoad(name, role, live=True, draining=False, answered=True,
                      **figures)  # type: ignore[arg-type]  # the float fields, by name


def snapshot(at: float, workers: tuple[WorkerLoad, ...] = (), requests: float = 0.0) -> LoadSnapshot:
    return LoadSnapshot(at, requests, requests, 10 * requests, 5 * requests, 0, ((float("inf"), 0.0),),
                        ((float("inf"), 0.0),), 64, workers)


def test_window_counts_a_remote_prefill_once_from_either_side() -> None:
    workers = (worker("p0", "prefill", jobs=3), worker("d0", "decode", waiting_for_kv=2, kv_used=0.5),
               worker("d1", "decode", waiting_for_kv=2, kv_used=0.3),
               WorkerLoad("d2", "decode", live=True, draining=True, answered=True, kv_used=1.0))
    w = measure(snapshot(0, requests=10), snapshot(5, workers, requests=20))
    assert w is not None and w.prefill_in_flight == 4 and w.decode_kv == pytest.approx(0.4)  # d2 drains
    assert (w.request_rate, w.prompt_rate, w.generation_rate, w.ttft_p90, w.idle) == (2, 20, 10, None, False)
    assert measure(snapshot(5), snapshot(5)) is None


class FixedPlanner(Planner):
    """Decides what it is told, and remembers what it was asked."""

    def __init__(self, decisions: list[Decision], **config: object) -> None:
        super().__init__(AutoscaleConfig.from_dict({**CFG, **config}), 64)
        self.decisions = decisions
        self.asked: list[tuple[LoadSnapshot, LoadSnapshot, dict[str, int]]] = []

    def decide(self, old: LoadSnapshot, new: LoadSnapshot, sizes: dict[str, int], now: float) -> list[Decision]:
        self.asked.append((old, new, sizes))
        return list(self.decisions)


DECISIONS = [Decision("decode", "up", 3, "tpot_p90", "p90 TPOT 0.4 s > 0.25 s"),
             Decision("prefill", "up", 9, "ttft_p90", "refused"),
             Decision("router", "set", 128, "prefill_bottleneck", "prefill at max"),
             Decision("prefill", "down", 1, "idle", "no request")]


def test_the_loop_applies_logs_and_records_every_decision(caplog: pytest.LogCaptureFixture) -> None:
    scaled, thresholds, recorded = [], [], []

    def scale(pool: str, target: int, reason: str) -> None:
        if target > 8:
            raise ValueError(f"{pool}: {target} is above autoscale.{pool}.max (8)")
        scaled.append((pool, target, reason))

    loop = PlannerLoop(FixedPlanner(DECISIONS), lambda: snapshot(time.monotonic()), scale, thresholds.append,
                       recorded.append)
    with caplog.at_level(logging.INFO, logger="pdserve.autoscale"):
        assert loop.run_once() == DECISIONS
    assert scaled == [("decode", 3, "tpot_p90"), ("prefill", 1, "idle")] and thresholds == [128]
    assert recorded == DECISIONS  # the refused one too: it was decided
    logs = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "pdserve.autoscale"]
    assert (logging.WARNING, "autoscale: decode scale up to 3 (tpot_p90): p90 TPOT 0.4 s > 0.25 s") in logs
    assert (logging.INFO, "autoscale: router.remote_prefill_min_tokens set to 128 (prefill_bottleneck): "
                          "prefill at max") in logs
    assert any(level == logging.WARNING and "not applied: prefill: 9 is above" in text for level, text in logs)


def test_the_loop_compares_with_the_snapshot_one_window_old() -> None:
    clock = [0.0]
    pools = (worker("p0", "prefill"), worker("d0", "decode"), worker("d1", "decode"),
             WorkerLoad("d2", "decode", live=False, draining=False, answered=False))
    planner_ = FixedPlanner([], window_s=30)
    loop = PlannerLoop(planner_, lambda: snapshot(clock[0], pools), lambda *a: None, lambda v: None,
                       lambda d: None, clock=lambda: clock[0])
    for t in range(0, 100, 10):
        clock[0] = float(t)
        loop.run_once()
    assert [(old.at, new.at) for old, new, _ in planner_.asked] == \
        [(0, 0), (0, 10), (0, 20), (0, 30), (10, 40), (20, 50), (30, 60), (40, 70), (50, 80), (60, 90)]
    assert planner_.asked[-1][2] == {"prefill": 1, "decode": 2}  # live, not draining


def wait_for(condition, timeout: float = 2.0) -> None:  # type: ignore[no-untyped-def]  # any callable
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_the_loop_survives_failing_passes_and_stops_promptly() -> None:
    calls, scaled = [0], []

    def take() -> LoadSnapshot:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("a stats reply that could not be read")
        return snapshot(time.monotonic())

    def scale(pool: str, target: int, reason: str) -> None:
        scaled.append(target)
        if len(scaled) == 1:
            raise RuntimeError("the scaler broke once")

    planner_ = FixedPlanner([DECISIONS[0]], interval_s=0.01, window_s=0.01)
    loop = PlannerLoop(planner_, take, scale, lambda v: None, lambda d: None)
    loop.start()
    try:
        wait_for(lambda: len(scaled) >= 3)
    finally:
        loop.stop()
    assert calls[0] >= 4 and not loop.alive

    slow = PlannerLoop(FixedPlanner([], interval_s=60, window_s=60), lambda: snapshot(time.monotonic()),
                       lambda *a: None, lambda v: None, lambda d: None)
    slow.start()
    wait_for(lambda: len(slow.planner.asked) == 1)  # type: ignore[attr-defined]  # FixedPlanner.asked
    started = time.monotonic()
    slow.stop()
    assert time.monotonic() - started < 0.5 and not slow.alive


def test_stop_during_a_pass_applies_no_further_decision() -> None:
    entered, release, scaled = threading.Event(), threading.Event(), []

    def scale(pool: str, target: int, reason: str) -> None:
        scaled.append(target)
        entered.set()
        release.wait(2)

    loop = PlannerLoop(FixedPlanner(DECISIONS), lambda: snapshot(time.monotonic()), scale, lambda v: None,
                       lambda d: None)
    loop.start()
    assert entered.wait(2)
    stopper = threading.Thread(target=loop.stop)
    stopper.start()
    time.sleep(0.02)
    release.set()
    stopper.join(2)
    assert scaled == [3] and not loop.alive


def ttft_snapshot(at: float, slow: float, min_tokens: int, jobs: int = 0) -> LoadSnapshot:
    """`slow` requests with a TTFT of 3-5 s so far; an idle prefill pool of two (jobs
    each), a calm decode worker."""
    buckets = ((1.0, 0.0), (5.0, slow), (float("inf"), slow))
    workers = (worker("p0", "prefill", jobs=jobs), worker("p1", "prefill", jobs=jobs),
               worker("d0", "decode", kv_used=0.1))
    return LoadSnapshot(at, slow, slow, 100 * slow, 10 * slow, 0, buckets, ((float("inf"), 0.0),), min_tokens,
                        workers)


def test_a_slow_ttft_with_the_prefill_pool_idle_never_raises_the_threshold() -> None:
    """Raising it would only starve the prefill pool further: prompts go to the decode
    workers, whose prefill makes TTFT slow. A backlog on the prefill workers does."""
    p, sizes = planner(prefill={"min": 1, "max": 2}), {"prefill": 2, "decode": 1}
    decided = [d for t in range(0, 400, 10) for d in p.decide(ttft_snapshot(t - 30, t, 64), ttft_snapshot(t, t + 10, 64),
                                                             sizes, float(t))]
    assert not [d for d in decided if d.pool == "router"], decided
    busy = p.decide(ttft_snapshot(400, 400, 64, jobs=9), ttft_snapshot(430, 410, 64, jobs=9), sizes, 430.0)
    assert [(d.pool, d.target, d.reason) for d in busy] == [("router", 128, "prefill_bottleneck")]


def test_a_raised_threshold_comes_back_once_the_prefill_pool_idles_even_with_ttft_slow() -> None:
    p, sizes = planner(prefill={"min": 1, "max": 2}), {"prefill": 2, "decode": 1}
    decided = [d for t in range(0, 200, 10) for d in p.decide(ttft_snapshot(t - 30, t, 256),
                                                             ttft_snapshot(t, t + 10, 256), sizes, float(t))]
    assert [(d.pool, d.target, d.reason) for d in decided if d.pool == "router"][:1] == \
        [("router", 64, "prefill_recovered")]  # it computed nothing: straight back


def test_the_loop_counts_a_pools_cooldown_and_window_from_when_its_scale_was_done() -> None:
    clock = [0.0]

    def slow_scale(pool: str, target: int, reason: str) -> None:
        clock[0] += 100.0  # a worker that loads for 100 s

    planner_ = FixedPlanner([DECISIONS[0]])
    loop = PlannerLoop(planner_, lambda: snapshot(clock[0]), slow_scale, lambda v: None, lambda d: None,
                       clock=lambda: clock[0])
    loop.run_once()
    assert planner_._changed["decode"] == 100.0  # not 0.0, when it was decided
    clock[0] = 110.0
    planner_.decisions = []
    loop.run_once()
    assert planner_.asked[-1][0].at == 110.0  # no snapshot from before the new worker served


def test_window_reads_remote_prefill_work_and_time_between_tokens() -> None:
    old = snapshot(0, (worker("p0", "prefill", tokens_computed=1000), worker("p1", "prefill", tokens_computed=50)))
    itl = ((0.05, 10.0), (0.1, 100.0), (float("inf"), 100.0))
    new = dataclasses.replace(snapshot(5, (worker("p0", "prefill", tokens_computed=3000),  # +2000
                                           worker("p2", "prefill", tokens_computed=700))),  # new: from its next answer
                              itl=itl)
    w = measure(old, new)
    assert w is not None and w.prefill_rate == 400 and w.itl_p90 == pytest.approx(0.0944, abs=1e-3)
    assert measure(snapshot(0), snapshot(5)).itl_p90 is None


def test_a_slow_time_between_tokens_adds_a_decode_worker_before_any_request_finishes() -> None:
    """TPOT is observed when a request ends; the gaps between streamed tokens while it runs."""
    p = planner()
    slow = ((0.25, 0.0), (0.5, 50.0), (float("inf"), 50.0))
    calm = (worker("d0", "decode", kv_used=0.1), worker("p0", "prefill"))
    old = snapshot(0, calm)
    new = dataclasses.replace(snapshot(40, calm), itl=slow)
    assert p.decide(old, old, {"prefill": 1, "decode": 1}, 0.0) == []
    decided = p.decide(old, new, {"prefill": 1, "decode": 1}, 40.0)
    assert [(d.pool, d.action, d.reason) for d in decided] == [("decode", "up", "itl_p90")]


def test_an_idle_prefill_pool_goes_to_zero_even_while_decode_is_slow() -> None:
    """Short prompts, prefilled on the decode workers: the prefill worker computes
    nothing, whatever decode's latency (it is not prefill's to fix)."""
    sim = Sim(prefill=1, decode=1)
    p = planner(prefill={"min": 0, "max": 2}, decode={"min": 1, "max": 1})
    steps = drive(p, sim, [(300, Load(0.7, 0, 100))])  # decode utilisation 0.7: TPOT past half its target
    assert sim.figures["tpot"] > 0.125
    assert [(s.decision.pool, s.decision.target) for s in steps] == [("prefill", 0)]


def test_at_max_workers_a_pool_takes_a_worker_the_other_can_spare() -> None:
    sim = Sim(prefill=2, decode=1)
    p = planner(max_workers=3, prefill={"min": 0, "max": 2}, decode={"min": 1, "max": 2})
    steps = drive(p, sim, [(300, Load(1.5, 30, 100))])  # decode-heavy; prefill light
    moves = [(s.decision.pool, s.decision.action, s.decision.reason) for s in steps]
    assert moves[:2] == [("prefill", "down", "rebalance"), ("decode", "up", "tpot_p90")], moves
    assert sim.sizes["decode"] == 2 and "max_workers 3" in steps[0].decision.detail


def test_at_max_workers_a_busy_pool_keeps_its_workers_and_the_total_holds() -> None:
    rng = random.Random(1)
    sim = Sim(prefill=1, decode=2)
    p = planner(max_workers=3, prefill={"min": 0, "max": 3}, decode={"min": 1, "max": 3}, scale_up_cooldown_s=0,
                scale_down_cooldown_s=10)
    grew = 0
    for _ in range(40):
        load = Load(rng.choice([0, 0.5, 5, 20]), rng.choice([10, 1000, 4000]), rng.choice([2, 100, 400]))
        for step in drive(p, sim, [(rng.choice([30, 120]), load)]):
            grew += step.decision.action == "up"
            assert sim.prefill + sim.decode <= 3, step
    assert grew
    # Both pools short at once (prefill-heavy and decode-heavy): neither can spare one.
    sim = Sim(prefill=1, decode=2)
    assert drive(planner(max_workers=3, prefill={"min": 0, "max": 3}, decode={"min": 1, "max": 3}), sim,
                 [(300, Load(8, 1000, 100))]) == []


def test_prefill_short_at_its_max_moves_the_threshold_to_the_median_prompt_at_once() -> None:
    p, sizes = planner(prefill={"min": 1, "max": 2}), {"prefill": 2, "decode": 1}
    lengths = ((384, 0.0), (512, 30.0), (768, 90.0), (float("inf"), 100.0))  # 100 prompts, 30 up to 512 tokens
    old = ttft_snapshot(400, 400, 64, jobs=9)
    new = dataclasses.replace(ttft_snapshot(430, 410, 64, jobs=9), prompt_lengths=lengths)
    assert p.decide(old, old, sizes, 400.0) == []  # the first look: nothing before a window has passed
    decided = p.decide(old, new, sizes, 430.0)
    assert [(d.pool, d.target) for d in decided] == [("router", 598)]  # 512 + 256 * 20 / 60
    assert "the median prompt length (598 tokens)" in decided[0].detail
    # Still short at the median: the upper quartile (768 * 0.75 of the way: 512 + 256 * 45 / 60), then doubling.
    at_median = dataclasses.replace(new, remote_prefill_min_tokens=598)
    later = dataclasses.replace(at_median, at=460.0)
    decided = p.decide(old, later, sizes, 460.0)
    assert [(d.pool, d.target) for d in decided] == [("router", 704)]
    assert "the upper quartile prompt length (704 tokens)" in decided[0].detail
    assert [d.target for d in p.decide(old, dataclasses.replace(later, remote_prefill_min_tokens=704, at=490.0),
                                       sizes, 490.0)] == [1024]
    capped = planner(prefill={"min": 1, "max": 2}, min_tokens_max=300)
    capped.decide(old, old, sizes, 400.0)
    assert [d.target for d in capped.decide(old, new, sizes, 430.0)] == [300]


def test_a_prefill_worker_that_computes_nothing_is_calm_whatever_the_ttft() -> None:
    """First tokens slow while every prompt stays local (short prompts, decode workers
    queueing them), TPOT within its target: the breach is decode's (a decode worker
    more would help, not a prefill worker), and the idle prefill worker goes."""
    p = planner(prefill={"min": 0, "max": 2}, decode={"min": 1, "max": 1}, ttft_p90_s=2.5, scale_down_cooldown_s=20)
    workers = (worker("d0", "decode", kv_used=0.1), worker("p0", "prefill", tokens_computed=5000))
    decided = [d for t in range(0, 200, 10)
               for d in p.decide(dataclasses.replace(ttft_snapshot(t - 30, t, 64), workers=workers),
                                 dataclasses.replace(ttft_snapshot(t, t + 10, 64), workers=workers),
                                 {"prefill": 1, "decode": 1}, float(t))]
    # (the sizes given never change here, so it is decided again at each calm cooldown)
    assert {(d.pool, d.target, d.reason) for d in decided} == {("prefill", 0, "within_slo")}
    assert "decode the bottleneck" in decided[0].detail
    grows = planner(prefill={"min": 0, "max": 2}, ttft_p90_s=2.5)
    decided = [d for t in range(0, 50, 10)
               for d in grows.decide(dataclasses.replace(ttft_snapshot(t - 30, t, 64), workers=workers),
                                     dataclasses.replace(ttft_snapshot(t, t + 10, 64), workers=workers),
                                     {"prefill": 1, "decode": 1}, float(t))]
    assert [(d.pool, d.action, d.reason) for d in decided] == [("decode", "up", "ttft_p90")]


def test_at_max_workers_prefill_short_takes_a_worker_from_a_calm_decode_pool() -> None:
    """The other direction: prefill's TTFT breach must not count against decode's calm."""
    sim = Sim(prefill=1, decode=2)
    p = planner(max_workers=3, prefill={"min": 0, "max": 3}, decode={"min": 1, "max": 3})
    steps = drive(p, sim, [(600, Load(2, 1000, 4))])  # 2000 prompt tokens/s on one prefill worker; decode idle
    assert [(s.decision.pool, s.decision.action, s.decision.reason) for s in steps] == [
        ("decode", "down", "rebalance"), ("prefill", "up", "ttft_p90")]
    assert sim.sizes == {"prefill": 2, "decode": 1}


def test_a_prefill_worker_that_missed_an_ask_or_restarted_is_not_read_as_unused() -> None:
    busy = worker("p0", "prefill", tokens_computed=80_000)
    new = snapshot(40, (busy, worker("d0", "decode")))
    missed = snapshot(0, (WorkerLoad("p0", "prefill", live=True, draining=False, answered=False),))
    w = measure(missed, new)
    assert w is not None and not w.prefill_counted and not w.prefill_unused  # unknown, not idle
    restarted = measure(snapshot(0, (worker("p0", "prefill", tokens_computed=200_000),)), new)
    assert restarted is not None and restarted.prefill_rate == 2000 and not restarted.prefill_unused


def test_short_prompts_and_a_slow_decode_pool_do_not_bring_the_prefill_worker_back() -> None:
    """At prefill 0, a TTFT breach with no prompt long enough for the prefill pool is
    decode's: a prefill worker would compute nothing, go, and come back for ever."""
    p = planner(prefill={"min": 0, "max": 2}, decode={"min": 1, "max": 1}, scale_down_cooldown_s=60)
    sizes = {"prefill": 1, "decode": 1}

    def snap(t: float) -> LoadSnapshot:
        n = t / 10.0  # a request every 10 s; TTFT 3-5 s; every prompt 30 tokens
        workers = (worker("d0", "decode", kv_used=0.1),
                   *(worker(f"p{i}", "prefill") for i in range(sizes["prefill"])))
        return dataclasses.replace(snapshot(float(t), workers, requests=n),
                                   ttft=((1.0, 0.0), (5.0, n), (float("inf"), n)),
                                   prompt_lengths=((16, 0.0), (32, n), (float("inf"), n)))

    history: list[LoadSnapshot] = []
    decided = []
    for t in range(0, 1500, 10):
        new = snap(t)
        history.append(new)
        old = [s for s in history if s.at <= t - 30][-1:] or history[:1]
        for d in p.decide(old[0], new, dict(sizes), float(t)):
            sizes[d.pool] = d.target
            history = [new]
            decided.append((d.pool, d.action, d.target))
    assert decided == [("prefill", "down", 0)]


@pytest.mark.parametrize("other_state", ["pressed", "changed_recently", "not_calm"])
def test_at_max_workers_a_pool_that_cannot_spare_one_keeps_it(other_state: str) -> None:
    """Each of _spare's guards alone stops the rebalance: the other pool is a
    bottleneck itself, was changed within an up-cooldown, or is not calm."""
    p = planner(max_workers=3, prefill={"min": 0, "max": 2}, decode={"min": 1, "max": 2}, scale_up_cooldown_s=30)
    sizes = {"prefill": 2, "decode": 1}
    jobs = {"pressed": 9, "changed_recently": 0, "not_calm": 3}[other_state]  # 3 > 4 / 2 * (2 - 1): not calm
    slow = ((0.05, 0.0), (0.5, 50.0), (float("inf"), 50.0))  # time between tokens: decode is short

    def snap(t: float, p_jobs: int) -> LoadSnapshot:
        workers = (worker("d0", "decode", kv_used=0.1), worker("p0", "prefill", jobs=p_jobs),
                   worker("p1", "prefill", jobs=0))
        return dataclasses.replace(snapshot(t, workers), itl=slow if t else ())

    p.decide(snap(0, 0), snap(0, 0), sizes, 0.0)
    if other_state == "changed_recently":
        p.decide(snap(0, 0), snap(0, 0), {"prefill": 2, "decode": 1}, 20.0)  # (same sizes: nothing changes)
        p._observe_sizes({"prefill": 2, "decode": 1}, 20.0)
        p.applied("prefill", 20.0)  # a prefill scale took effect at 20 s
    decided = p.decide(snap(0, 0), snap(40, jobs), sizes, 40.0)
    assert not [d for d in decided if d.action == "up" or d.reason == "rebalance"], decided
    calm = p.decide(snap(0, 0), snap(60, 0), sizes, 60.0)  # once it can spare one, it does
    assert [(d.pool, d.reason) for d in calm][:2] == [("prefill", "rebalance"), ("decode", "itl_p90")]


def test_with_no_prefill_worker_long_prompts_bring_one_even_while_decode_is_short() -> None:
    """Decode at its max, slow from prefilling long prompts itself: a prefill worker
    takes them off it (the black-box run saw the planner add nothing for 35 s)."""
    slow_tpot = ((0.25, 0.0), (0.5, 10.0), (float("inf"), 10.0))

    def snap(t: float, lengths: tuple) -> LoadSnapshot:
        return dataclasses.replace(ttft_snapshot(t, t + 10, 64), workers=(worker("d0", "decode", kv_used=0.1),),
                                   tpot=slow_tpot if t else ((float("inf"), 0.0),), prompt_lengths=lengths)

    long_, short = ((512, 0.0), (768, 20.0), (float("inf"), 20.0)), ((32, 0.0), (64, 20.0), (float("inf"), 20.0))
    for lengths, wanted in ((long_, [("prefill", "up", "ttft_p90")]), (short, [])):
        q = planner(prefill={"min": 0, "max": 2}, decode={"min": 1, "max": 1})
        q.decide(snap(0, ()), snap(0, ()), {"prefill": 0, "decode": 1}, 0.0)
        decided = q.decide(snap(0, ()), snap(30, lengths), {"prefill": 0, "decode": 1}, 30.0)
        assert [(d.pool, d.action, d.reason) for d in decided] == wanted, lengths
