"""Workers counted while a deployment serves: every `period_s` the router's /admin/pools
(the workers it lists, draining ones included: they still run) and the worker processes
alive (those still loading included), so that worker-seconds are measured, not assumed
from the arm's shape; and the CPU time the deployment, this process and everything
else on the machine took meanwhile."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import psutil

from benchmarks.elastic.deployment import Deployment


@dataclass(frozen=True)
class Sample:
    t: float  # seconds from the trace's start
    prefill: int  # listed by the router, draining or (for now) unanswering included
    decode: int
    processes: int  # worker processes alive

    @property
    def workers(self) -> int:
        return self.prefill + self.decode


@dataclass
class PoolWatcher:
    deployment: Deployment
    t0: float  # time.perf_counter() at the trace's start
    period_s: float = 0.5
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cpu = CpuShares(self.deployment)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pool-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """One last sample (the run's end), then the thread ends."""
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while True:
            self._sample()
            # A sample slowed by a busy router must not stretch the period: aim at the grid.
            if self._stop.wait(self.period_s - (time.perf_counter() - self.t0) % self.period_s):
                self._sample()
                return

    def _sample(self) -> None:
        try:
            pools = self.deployment.admin("GET", "/admin/pools", timeout=10.0)
        except Exception as exc:  # a missed sample is recorded; the integral spans the gap
            self.errors.append(f"{time.perf_counter() - self.t0:.1f} s: {type(exc).__name__}: {exc}")
            return
        # Every worker listed counts, one the router holds dead for now (a missed
        # heartbeat on a busy machine) included: it still runs and holds its share.
        listed = {"prefill": 0, "decode": 0}
        for w in pools["workers"]:
            listed[w["role"]] += 1
        self.samples.append(Sample(time.perf_counter() - self.t0, listed["prefill"], listed["decode"],
                                   self.deployment.worker_processes()))
        self.cpu.sample()


class CpuShares:
    """Where the machine's CPU time went while the trace ran: the deployment's processes
    (its workers' start-up included, for those added), this benchmark process, and
    everything else (other users of a shared machine), in CPU-seconds. A process's time
    is read at each sample: one that exits between two loses at most a period's."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.first: dict[int, float] | None = None
        self.last: dict[int, float] = {}
        self.machine = self._busy()
        self.own = self._own()

    def sample(self) -> None:
        now = self.deployment.cpu_seconds()
        if self.first is None:
            self.first = dict(now)
        self.last.update(now)

    def totals(self) -> dict[str, float]:
        first = self.first or {}
        deployment = sum(t - first.get(pid, 0.0) for pid, t in self.last.items())
        bench = self._own() - self.own
        busy = self._busy() - self.machine
        return {"deployment_s": deployment, "benchmark_s": bench, "others_s": max(0.0, busy - deployment - bench),
                "cpus": psutil.cpu_count() or 1}

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    @staticmethod
    def _own() -> float:
        t = psutil.Process().cpu_times()
        return t.user + t.system


def integrate(samples: list[Sample], start: float, end: float, what: str = "workers") -> float:
    """The integral of `what` (workers or processes) over [start, end], each sample's
    value holding until the next one (the first one's from `start`)."""
    if not samples:
        return 0.0
    total = 0.0
    for i, s in enumerate(samples):
        lo = start if i == 0 else max(start, s.t)
        hi = min(end, samples[i + 1].t) if i + 1 < len(samples) else end
        if hi > lo:
            total += getattr(s, what) * (hi - lo)
    return total


def timeline(samples: list[Sample]) -> list[list[float]]:
    """[t, prefill, decode, processes] at each change (for the JSON)."""
    out: list[list[float]] = []
    for s in samples:
        row = [round(s.t, 2), s.prefill, s.decode, s.processes]
        if not out or out[-1][1:] != row[1:]:
            out.append(row)
    return out
