"""PoolScaler's rules with a fake backend and router (no process): bounds, up before
down, the newest workers leave first, a drain waits for idle workers and moves what a
decode worker still runs at the deadline, a prefill worker leaves once its jobs are
done, and a worker that does not start fails the request loudly. The real thing runs in
tests/disagg/test_elastic_pools.py."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from unittest import mock

import pytest

import cluster.autoscale.run as run
from cluster.autoscale.planner import Decision
from cluster.config import ClusterConfig
from cluster.elastic import Bounds, PoolScaler, ScaleError, ScaleFailed
from protocol import WorkerStats
from router.metrics import RouterMetrics
from tests.unit.test_planner import FixedPlanner, snapshot, wait_for
from tests.worker_stats import worker_stats


@dataclass
class FakeWorker:
    name: str
    address: str = ""
    draining: bool = False


class FakeBackend:
    def __init__(self, prefill: int, decode: int, fail: bool = False) -> None:
        self.pools = {"prefill": [FakeWorker(f"prefill-{i}") for i in range(prefill)],
                      "decode": [FakeWorker(f"decode-{i}") for i in range(decode)]}
        self.fail = fail
        self.log: list[tuple[str, str]] = []

    def pool(self, role: str) -> list[FakeWorker]:
        return self.pools[role]

    def add_worker(self, role: str) -> FakeWorker:
        if self.fail:
            raise RuntimeError("out of memory")
        w = FakeWorker(f"{role}-{len(self.pools[role]) + 10}", "tcp://new")
        self.pools[role].append(w)
        self.log.append(("add", w.name))
        return w

    def set_draining(self, name: str) -> None:
        self._find(name).draining = True
        self.log.append(("draining", name))

    def remove_worker(self, name: str) -> None:
        w = self._find(name)
        self.pools[name.rpartition("-")[0]].remove(w)
        self.log.append(("remove", name))

    def _find(self, name: str) -> FakeWorker:
        return next(w for pool in self.pools.values() for w in pool if w.name == name)


class FakeRouter:
    def __init__(self) -> None:
        self.requests: dict[str, int] = {}  # decode worker -> sequences the router awaits
        self.jobs: dict[str, int] = {}  # prefill worker -> jobs in flight
        self.down: set[str] = set()  # workers the router sees dead
        self.log: list[tuple[str, str]] = []

    def add_worker(self, role: str, name: str, address: str, timeout: float = 30.0) -> None:
        self.log.append(("router-add", name))

    def drain_worker(self, name: str, timeout: float = 30.0) -> None:
        self.log.append(("router-drain", name))

    def requests_on(self, name: str, timeout: float = 30.0) -> int:
        return self.requests.get(name, 0)

    def evacuate(self, name: str, timeout: float = 30.0) -> int:
        self.log.append(("evacuate", name))
        moved, self.requests[name] = self.requests.get(name, 0), 0
        return moved

    def remove_worker(self, name: str, timeout: float = 30.0) -> None:
        self.log.append(("router-remove", name))

    def worker_stats(self, name: str, timeout: float = 5.0) -> WorkerStats | None:
        return worker_stats(jobs=self.jobs.get(name, 0))

    def worker_live(self, name: str, timeout: float = 30.0) -> bool:
        return name not in self.down


def scaler(prefill: int = 1, decode: int = 1, drain: float = 5.0, fail: bool = False) \
        -> tuple[PoolScaler, FakeBackend, FakeRouter]:
    backend, router = FakeBackend(prefill, decode, fail), FakeRouter()
    router.log = backend.log  # one log: the order between them matters
    return PoolScaler(backend, router, Bounds(prefill=(0, 3), decode=(1, 3)), drain, poll_s=0.01), backend, router


@pytest.mark.parametrize("targets, words", [
    ({"decode": 0}, "decode: cannot scale to 0 workers"),
    ({"decode": 4}, "decode: 4 is beyond autoscale.decode.max (3)"),
    ({"prefill": -1}, "prefill: -1 is below autoscale.prefill.min (0)"),
    ({"prefill": 1.5}, "prefill: must be an integer"),
])
def test_a_target_out_of_bounds_is_refused_and_nothing_is_done(targets, words) -> None:
    s, backend, router = scaler()
    with pytest.raises(ScaleError, match=words.replace("(", r"\(").replace(")", r"\)")):
        s.scale(**targets)
    assert backend.log == [] and router.log == []


def budget_scaler(prefill: int, decode: int, total: int) -> tuple[PoolScaler, FakeBackend]:
    backend, router = FakeBackend(prefill, decode), FakeRouter()
    router.log = backend.log
    return PoolScaler(backend, router, Bounds(prefill=(0, 3), decode=(1, 3), total=total), 5.0, poll_s=0.01), backend


def test_a_target_beyond_max_workers_is_refused_and_nothing_is_done() -> None:
    s, backend = budget_scaler(prefill=1, decode=2, total=3)
    with pytest.raises(ScaleError, match=r"prefill 2 \+ decode 2 = 4 workers is beyond autoscale.max_workers \(3\)"):
        s.scale(prefill=2)
    assert backend.log == []
    s.scale(prefill=2, decode=1)  # within the budget once the decode pool shrinks in the same call
    assert s.sizes() == {"prefill": 2, "decode": 1}


def test_at_max_workers_the_leaving_worker_drains_before_the_new_one_starts() -> None:
    s, backend = budget_scaler(prefill=2, decode=1, total=3)
    s.scale(prefill=1, decode=2)
    order = [event for event in backend.log if event[0] in ("remove", "add")]
    assert order == [("remove", "prefill-1"), ("add", "decode-11")]  # never 4 at once
    s, backend = budget_scaler(prefill=1, decode=1, total=4)  # room for both: capacity first, as usual
    s.scale(prefill=0, decode=2)
    assert [event for event in backend.log if event[0] in ("remove", "add")] == [("add", "decode-11"),
                                                                               ("remove", "prefill-0")]


def test_up_comes_before_down_and_the_router_learns_a_worker_once_it_serves() -> None:
    s, backend, router = scaler(prefill=2, decode=1)
    result = s.scale(prefill=1, decode=2)
    assert result.added == ["decode-11"] and result.removed == ["prefill-1"]
    assert backend.log[:2] == [("add", "decode-11"), ("router-add", "decode-11")]
    assert s.sizes() == {"prefill": 1, "decode": 2}


def test_the_newest_workers_leave_first_and_a_prefill_worker_leaves_the_backend_before_the_router() -> None:
    s, backend, router = scaler(prefill=3, decode=3)
    result = s.scale(prefill=1, decode=1)
    assert sorted(result.removed) == ["decode-1", "decode-2", "prefill-1", "prefill-2"]
    assert [w.name for w in backend.pools["decode"]] == ["decode-0"]
    # A prefill worker: out of the decode workers' peers first (their prompts fall back),
    # then out of the router; a decode worker the other way round.
    log = backend.log
    assert log.index(("remove", "prefill-2")) < log.index(("router-remove", "prefill-2"))
    assert log.index(("router-remove", "decode-2")) < log.index(("remove", "decode-2"))
    assert log.index(("router-drain", "decode-2")) < log.index(("router-remove", "decode-2"))


def test_a_drain_waits_for_the_decode_workers_requests_then_moves_them_at_the_deadline() -> None:
    s, backend, router = scaler(decode=2, drain=0.3)
    router.requests["decode-1"] = 2  # never finish by themselves
    result = s.scale(decode=1)
    assert result.moved == 2 and ("evacuate", "decode-1") in router.log
    assert router.log.index(("evacuate", "decode-1")) < router.log.index(("router-remove", "decode-1"))


def test_a_drained_decode_worker_leaves_as_soon_as_it_is_idle_without_moving_anything() -> None:
    s, backend, router = scaler(decode=2, drain=30.0)
    router.requests["decode-1"] = 1
    threading.Timer(0.2, lambda: router.requests.update({"decode-1": 0})).start()
    result = s.scale(decode=1)
    assert result.moved == 0 and result.seconds < 5 and ("evacuate", "decode-1") not in router.log


def test_a_draining_prefill_worker_finishes_its_jobs_before_it_leaves() -> None:
    s, backend, router = scaler(prefill=2, drain=30.0)
    router.jobs["prefill-1"] = 3
    threading.Timer(0.3, lambda: router.jobs.update({"prefill-1": 0})).start()
    result = s.scale(prefill=1)
    assert result.removed == ["prefill-1"] and 0.25 < result.seconds < 5
    assert backend.log[:2] == [("router-drain", "prefill-1"), ("draining", "prefill-1")]


def test_a_worker_that_does_not_start_fails_the_request_loudly() -> None:
    s, backend, router = scaler(fail=True)
    with pytest.raises(ScaleFailed, match="decode: a new worker did not start: out of memory"):
        s.scale(decode=2)
    assert backend.log == []


def test_a_target_decided_from_sizes_another_scale_changed_is_not_applied() -> None:
    s, backend, router = scaler(decode=2)
    s.scale(decode=3)
    with pytest.raises(ScaleError, match="decode: has 3 workers now, not the 2 this target was decided from"):
        s.scale(decode=2, expect={"decode": 2})  # the planner's "down from 2" after a scale by hand to 3
    assert s.sizes()["decode"] == 3 and not any(kind == "remove" for kind, _ in backend.log)


def test_the_planners_step_up_waiting_for_a_scale_by_hand_does_not_undo_it() -> None:
    """The planner reads decode 2 while an operator's scale to 3 loads its worker, and
    decides one more (3): after the operator's scale that is no step at all, and it
    must not drain what the operator added, nor add one more."""
    loading, release = threading.Event(), threading.Event()

    class SlowBackend(FakeBackend):
        def add_worker(self, role: str) -> FakeWorker:
            loading.set()
            release.wait(5)
            return super().add_worker(role)

    backend, router = SlowBackend(1, 2), FakeRouter()
    s = PoolScaler(backend, router, Bounds(prefill=(0, 4), decode=(1, 4)), 0.0, poll_s=0.01)
    operator = threading.Thread(target=s.scale, kwargs={"decode": 4})
    operator.start()
    assert loading.wait(5)
    planner = FixedPlanner([], interval_s=60, window_s=60)
    planner.decisions = [Decision("decode", "up", 3, "tpot_p90", "decided from decode 2")]
    config = ClusterConfig.from_dict({"model": "/nonexistent", "decode": {"replicas": 2},
                                      "autoscale": {"enabled": True, "decode": {"min": 1, "max": 4}}})
    control = SimpleNamespace(snapshot=lambda: snapshot(time.monotonic()), set_remote_prefill_min_tokens=lambda v: None)
    deployment = SimpleNamespace(scaler=s, metrics=RouterMetrics(), control=control)
    with mock.patch.object(run, "Planner", lambda config, base: planner):
        loop = run.start_planner(config, deployment)  # type: ignore[arg-type]  # a stand-in deployment, not a Router
    assert loop is not None
    try:
        wait_for(lambda: planner.asked)  # it decided from decode 2 and waits for the operator
        assert planner.asked[0][2]["decode"] == 2
        release.set()
        operator.join(5)
        wait_for(lambda: deployment.metrics.autoscale_decisions.labels(
            pool="decode", action="up", reason="tpot_p90")._value.get() == 1)
    finally:
        loop.stop()
    assert [w.name for w in backend.pools["decode"]] == ["decode-0", "decode-1", "decode-12", "decode-13"]
    assert not any(kind == "remove" for kind, _ in backend.log)


def test_a_scale_down_takes_the_workers_that_are_down_first() -> None:
    """decode-0 crashed (being restarted): scaling 3 -> 2 removes it, not the newest,
    which serves; then the newest again."""
    s, backend, router = scaler(decode=3)
    router.down.add("decode-0")
    assert s.scale(decode=2).removed == ["decode-0"]
    assert [w.name for w in backend.pools["decode"]] == ["decode-1", "decode-2"]
    assert s.scale(decode=1).removed == ["decode-2"]


def test_a_worker_the_router_cannot_add_is_taken_out_of_its_pool_again() -> None:
    s, backend, router = scaler()

    def refuse(role: str, name: str, address: str, timeout: float = 30.0) -> None:
        raise TimeoutError("the router's loop did not answer")
    router.add_worker = refuse
    with pytest.raises(ScaleFailed, match="the router could not add decode-11"):
        s.scale(decode=2)
    assert backend.log == [("add", "decode-11"), ("remove", "decode-11")] and s.sizes()["decode"] == 1


def test_a_drain_that_fails_part_way_leaves_no_worker_draining_for_ever() -> None:
    s, backend, router = scaler(prefill=3, decode=1, drain=30.0)
    router.jobs.update({"prefill-1": 1, "prefill-2": 1})  # both still busy when the step fails

    def broken(name: str, timeout: float = 5.0) -> WorkerStats:
        raise TimeoutError("no stats reply")
    router.worker_stats = broken
    with pytest.raises(ScaleFailed, match="scale-down failed while draining: TimeoutError"):
        s.scale(prefill=1)
    assert [w.name for w in backend.pools["prefill"]] == ["prefill-0"]
    assert ("router-remove", "prefill-1") in backend.log and ("router-remove", "prefill-2") in backend.log
