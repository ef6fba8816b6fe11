"""The chaos run's schedule (benchmarks/chaos/run.py): when each fault happens, drawn from
a seed, and the lanes that carry it out against a running deployment.

Two process lanes, one per pool, each faulting one worker at a time: SIGKILL (the
supervisor restarts it) or SIGSTOP for a few seconds, then SIGCONT. A lane waits for
its worker to be live again before its next fault, so the decode lane never takes
both decode workers down and a request has a live decode worker to fail over to. A
third lane sends the hostile input: fuzz bursts, floods and forged worker messages.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from benchmarks.chaos.deploy import Deployment


@dataclass
class Event:
    at: float  # seconds after the load started
    lane: str  # "prefill", "decode" or "attack"
    action: str  # kill, stop | fuzz, flood, forge
    worker: str = ""  # the process lanes' target
    stop_s: float = 0.0  # how long a SIGSTOP lasts
    part: int = 0  # which slice of the fuzz corpus


@dataclass
class Fault:
    """A process fault as it happened: its worker counts as down from `start` until
    `end`, when the router saw it live again (a new pid after a kill)."""

    action: str
    worker: str
    pid: int
    start: float  # time.monotonic()
    end: float | None = None
    note: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def schedule(seed: int, seconds: float, decode_worker: str, prefill_worker: str, fuzz_parts: int,
             per_lane: int | None = None) -> list[Event]:
    """Events spread over [10%, 70%] of the load (a lane late for its next event, still
    waiting for a recovery, runs it as soon as it can): per process lane, per minute,
    about one kill and one stop (at least two of each; per_lane: that many each); the
    fuzz corpus in fuzz_parts bursts; floods and forgeries, at least two each."""
    rng = random.Random(seed)
    minutes = seconds / 60
    lo, hi = 0.1 * seconds, 0.7 * seconds
    events = []
    for lane, worker in (("prefill", prefill_worker), ("decode", decode_worker)):
        n = per_lane if per_lane is not None else max(2, round(minutes))
        actions = ["kill"] * n + ["stop"] * n
        rng.shuffle(actions)
        times = sorted(rng.uniform(lo, hi) for _ in actions)
        events += [Event(t, lane, a, worker, stop_s=rng.uniform(2.0, 12.0) if a == "stop" else 0.0)
                   for t, a in zip(times, actions)]
    attacks = ([("fuzz", part) for part in range(fuzz_parts)] + [("flood", 0)] * max(2, round(minutes / 2))
               + [("forge", 0)] * max(2, round(minutes / 4)))
    events += [Event(rng.uniform(lo, hi), "attack", a, part=p) for a, p in attacks]
    return sorted(events, key=lambda e: e.at)


class ProcessLane:
    """Carries out one pool's faults in order, one at a time."""

    def __init__(self, deployment: Deployment, events: list[Event], t0: float, hurry: threading.Event,
                 recover_timeout_s: float = 120.0) -> None:
        self.d, self.events, self.t0, self.hurry = deployment, events, t0, hurry
        self.recover_timeout_s = recover_timeout_s
        self.faults: list[Fault] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _live_pid(self, worker: str, not_pid: int | None = None) -> int | None:
        """The worker's pid once the router sees it live (and, after a kill, a new one)."""
        end = time.monotonic() + self.recover_timeout_s
        while time.monotonic() < end:
            s = self.d.latest
            pid = s.pids.get(worker)
            if s.live.get(worker) and pid and pid != not_pid:
                return pid
            time.sleep(0.1)
        return None

    def _run(self) -> None:
        """Every fault, each run to its recovery, so the run ends with every worker back;
        once `hurry` is set (the load's time is up) those left run one after another."""
        for e in self.events:
            self.hurry.wait(max(0.0, self.t0 + e.at - time.monotonic()))
            pid = self._live_pid(e.worker)
            if pid is None:
                self.faults.append(Fault(e.action, e.worker, 0, time.monotonic(), note="skipped: not live"))
                continue
            fault = Fault(e.action, e.worker, pid, time.monotonic())
            self.faults.append(fault)
            if e.action == "kill":
                if not self.d.signal(pid, signal.SIGKILL):
                    fault.note = "not our worker any more"
                after = pid
            else:
                self.d.signal(pid, signal.SIGSTOP)
                time.sleep(e.stop_s)
                self.d.signal(pid, signal.SIGCONT)
                fault.note = f"stopped {e.stop_s:.1f} s"
                after = None
            if self._live_pid(e.worker, not_pid=after) is not None:
                fault.end = time.monotonic()
            else:
                fault.note += "; not live again within the recovery timeout"


class AttackLane:
    """Runs every attack event in order, each by its handler. Once `hurry` is set (the
    load's time is up) the events left run at once rather than at their times, so the
    whole corpus is always sent; the load goes on until they are done."""

    def __init__(self, events: list[Event], t0: float, hurry: threading.Event,
                 handlers: dict[str, Callable[[Event], None]]) -> None:
        self.events, self.t0, self.hurry, self.handlers = events, t0, hurry, handlers
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        for e in self.events:
            self.hurry.wait(max(0.0, self.t0 + e.at - time.monotonic()))
            self.handlers[e.action](e)
