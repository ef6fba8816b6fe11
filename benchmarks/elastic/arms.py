"""The arms the trace is played against, and the config each deploys:
- fixed "NpMd": N prefill and M decode workers throughout;
- "scripted": the pools set by the admin endpoint at each phase's start to a shape
  chosen for that phase in advance (an oracle schedule: a reference, not a planner);
- "autoscaled": the config's `autoscale:` section on, starting at 1P1D; the deployment's
  own planner (cluster/autoscale/) decides.
No arm may have more than `max_workers` workers at once."""

from __future__ import annotations

import copy
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.elastic.deployment import Deployment

_SHAPE = re.compile(r"^(\d+)p(\d+)d$")


@dataclass(frozen=True)
class Shape:
    prefill: int
    decode: int

    @classmethod
    def parse(cls, text: str, option: str) -> Shape:
        m = _SHAPE.match(text.strip().lower())
        if not m:
            raise ValueError(f"{option}: {text!r} is not a shape such as 1p2d (prefill and decode workers)")
        shape = cls(int(m[1]), int(m[2]))
        if shape.decode < 1:
            raise ValueError(f"{option}: {text!r} has no decode worker (the decode pool serves every request)")
        return shape

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    def __str__(self) -> str:
        return f"{self.prefill}p{self.decode}d"


@dataclass(frozen=True)
class Arm:
    name: str  # "1p1d", "scripted", "autoscaled"
    start: Shape  # the deployment's shape when the trace starts
    script: tuple[Shape, ...] = ()  # scripted: the shape of each phase
    autoscale: dict[str, Any] | None = None  # autoscaled: the config's autoscale section

    def config(self, base: dict[str, Any]) -> dict[str, Any]:
        """The cluster config this arm deploys: `base` with its pools' replicas set."""
        out = copy.deepcopy(base)
        for role in ("prefill", "decode"):
            out[role] = {**(out.get(role) or {}), "replicas": getattr(self.start, role)}
        if self.autoscale is not None:
            out["autoscale"] = self.autoscale
        return out


def parse_arms(text: str, script: str, phases: int, max_workers: int,
               autoscale: dict[str, Any]) -> list[Arm]:
    """--arms: a comma-separated list of fixed shapes, "scripted" and "autoscaled"."""
    arms = []
    for name in (a.strip().lower() for a in text.split(",")):
        if name == "scripted":
            shapes = tuple(Shape.parse(s, "--script") for s in script.split(","))
            if len(shapes) != phases:
                raise ValueError(f"--script: {len(shapes)} shapes ({script}) for a trace of {phases} phases")
            arm = Arm("scripted", shapes[0], shapes)
        elif name == "autoscaled":
            arm = Arm("autoscaled", Shape(1, 1), autoscale=autoscale)
        else:
            arm = Arm(name, Shape.parse(name, "--arms"))
        for shape in (arm.start, *arm.script):
            if shape.workers > max_workers:
                raise ValueError(f"arm {name}: {shape} has {shape.workers} workers, beyond --max-workers "
                                 f"{max_workers}")
        if any(a.name == arm.name for a in arms):
            raise ValueError(f"--arms: {name} is given twice")
        arms.append(arm)
    return arms


@dataclass
class ScriptedScaler:
    """At each phase's start (after the first: the deployment starts in its shape), sets
    the pools to that phase's shape through /admin/scale: shrinking pools first, then
    growing ones, each its own call, so that the arm never has more workers than its
    largest shape (PoolScaler grows before it shrinks within one call)."""

    deployment: Deployment
    script: tuple[Shape, ...]
    starts: list[float]  # each phase's start, seconds from the trace's start
    t0: float  # time.perf_counter() at the trace's start
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scripted-scaler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(600)  # a scale under way is waited for: its workers must not outlive the arm

    def _run(self) -> None:
        for before, shape, at in zip(self.script, self.script[1:], self.starts[1:]):
            if self._stop.wait(max(0.0, self.t0 + at - time.perf_counter())):
                return
            down = {role: getattr(shape, role) for role in ("prefill", "decode")
                    if getattr(shape, role) < getattr(before, role)}
            up = {role: getattr(shape, role) for role in ("prefill", "decode")
                  if getattr(shape, role) > getattr(before, role)}
            for targets in (down, up):
                if targets:
                    self._call(targets)

    def _call(self, targets: dict[str, int]) -> None:
        sent = time.perf_counter() - self.t0
        record: dict[str, Any] = {"t": round(sent, 2), "targets": targets}
        try:
            record["result"] = self.deployment.admin("POST", "/admin/scale", targets, timeout=600.0)
        except Exception as exc:  # recorded in the report; the run goes on at the old shape
            record["error"] = f"{type(exc).__name__}: {exc}"
        record["seconds"] = round(time.perf_counter() - self.t0 - sent, 2)
        self.calls.append(record)
