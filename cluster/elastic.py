"""Pools that grow and shrink while the deployment serves: `PoolScaler.scale()`, which
`pdserve scale`, the router's admin endpoint and the autoscaling planner call.

Scale-up: a launcher's PoolBackend starts a worker by the path a restarted one takes
(it gets its peers and serves, then the other pool learns it), and only then does the
router route to it.

Scale-down drains, workers the router sees down first, then the newest:
- decode: the router sends it no new request; the requests it serves finish, until
  `drain_timeout_s`; those still running then move to the other decode workers by the
  failover path (each resubmitted as prompt + its tokens so far: greedy output goes on
  token for token). Then the router forgets it, and the backend takes it out of its
  pool (prefill workers drop it as a KV destination) and stops it.
- prefill: the decode workers send it no new prompt, and those it computes finish,
  until `drain_timeout_s`; then the backend takes it out (the decode workers prefill
  locally any prompt it still had) and stops it, and the router forgets it.
No request fails because of a scale event: each either finishes where it was or moves.

Growing goes before shrinking (capacity before it goes), unless the deployment would
then pass `autoscale.max_workers` (both pools together): then the leaving workers drain
first. A target beyond that bound is refused, as one beyond a pool's own.

One scale at a time (a lock): a request made while another runs waits for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cluster.config import ClusterConfig
from cluster.launcher import NamedWorker
from protocol import WorkerStats

logger = logging.getLogger("pdserve.scale")

ROLES = ("prefill", "decode")


class ScaleError(ValueError):
    """A scale request out of bounds (nothing was done)."""


class ScaleFailed(RuntimeError):
    """A new worker would not start (those started before it stay)."""


class PoolBackend(Protocol):
    """What a launcher does for the scaler (cluster/local/elastic.py, cluster/ray/elastic.py)."""

    def pool(self, role: str) -> Sequence[NamedWorker]: ...

    def add_worker(self, role: str) -> NamedWorker:
        """Start a worker of `role` under a new name; return it once it serves and the
        other pool knows it. Raises (leaving nothing behind) if it cannot."""

    def set_draining(self, name: str) -> None:
        """Mark it draining; a prefill worker's decode peers are told to send it nothing new."""

    def remove_worker(self, name: str) -> None:
        """Take it out of its pool, tell the other pool, stop it and release its placement."""


class RouterControl(Protocol):
    """The router's verbs the scaler uses (router/control.py RouterControl)."""

    def add_worker(self, role: str, name: str, address: str, timeout: float = 30.0) -> None: ...

    def drain_worker(self, name: str, timeout: float = 30.0) -> None: ...

    def requests_on(self, name: str, timeout: float = 30.0) -> int: ...

    def evacuate(self, name: str, timeout: float = 30.0) -> int: ...

    def remove_worker(self, name: str, timeout: float = 30.0) -> None: ...

    def worker_stats(self, name: str, timeout: float = 5.0) -> WorkerStats | None: ...

    def worker_live(self, name: str, timeout: float = 30.0) -> bool: ...


@dataclass(frozen=True)
class Bounds:
    """How many workers each pool may have (autoscale.prefill / autoscale.decode)."""

    prefill: tuple[int, int]  # (min, max)
    decode: tuple[int, int]
    total: int | None = None  # the most workers of both pools together (autoscale.max_workers)

    def of(self, role: str) -> tuple[int, int]:
        return self.prefill if role == "prefill" else self.decode


def scaler_for(config: ClusterConfig, backend: PoolBackend, router: RouterControl) -> PoolScaler:
    """The scaler of a deployment: its config's autoscale bounds (which scale requests,
    manual or the planner's, keep within) and drain timeout."""
    auto = config.autoscale
    bounds = Bounds(prefill=(auto.prefill.min, auto.prefill.max), decode=(auto.decode.min, auto.decode.max),
                    total=auto.total_max)
    return PoolScaler(backend, router, bounds, auto.drain_timeout_s)


@dataclass
class ScaleResult:
    sizes: dict[str, int]  # workers taking work in each pool, after
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    moved: int = 0  # sequences a drain timeout moved to another decode worker
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"prefill": self.sizes["prefill"], "decode": self.sizes["decode"], "added": self.added,
                "removed": self.removed, "moved_requests": self.moved, "seconds": round(self.seconds, 3)}


class PoolScaler:
    def __init__(self, backend: PoolBackend, router: RouterControl, bounds: Bounds, drain_timeout_s: float,
                 poll_s: float = 0.2) -> None:
        self.backend = backend
        self.router = router
        self.bounds = bounds
        self.drain_timeout_s = drain_timeout_s
        self.poll_s = poll_s
        self._lock = threading.Lock()

    def sizes(self) -> dict[str, int]:
        """Workers taking work in each pool (a draining one no longer counts)."""
        return {role: sum(1 for w in self.backend.pool(role) if not getattr(w, "draining", False)) for role in ROLES}

    def check(self, targets: dict[str, int | None]) -> None:
        """ScaleError naming the pool and its bound for a target out of bounds."""
        for role, target in targets.items():
            if target is None:
                continue
            if role not in ROLES:
                raise ScaleError(f"unknown pool {role!r}; the pools are {ROLES}")
            if not isinstance(target, int) or isinstance(target, bool):
                raise ScaleError(f"{role}: must be an integer number of workers, got {target!r}")
            low, high = self.bounds.of(role)
            if role == "decode" and target < 1:
                raise ScaleError(f"decode: cannot scale to {target} workers: the decode pool serves every request "
                                 "(at least 1)")
            if target < low:
                raise ScaleError(f"{role}: {target} is below autoscale.{role}.min ({low})")
            if target > high:
                raise ScaleError(f"{role}: {target} is beyond autoscale.{role}.max ({high})")

    def scale(self, prefill: int | None = None, decode: int | None = None, reason: str = "manual",
              expect: dict[str, int] | None = None) -> ScaleResult:
        """Bring each pool given to its target, up first then down (capacity before it
        goes), or down first where growing first would pass the bound on both pools
        together; returns once done. ScaleError for a target out of bounds (nothing
        done), ScaleFailed for a worker that would not start (those that did, stay).

        expect: the pools' sizes the target was computed from (the planner's one step
        up or down). A scale made meanwhile (one waits for another) changed them: then
        ScaleError and nothing is done, for the target no longer means that step."""
        targets = {"prefill": prefill, "decode": decode}
        self.check(targets)
        with self._lock:
            sizes = self.sizes()
            for role, size in (expect or {}).items():
                if sizes[role] != size:
                    raise ScaleError(f"{role}: has {sizes[role]} workers now, not the {size} this target was "
                                     "decided from (another scale ran meanwhile)")
            after = {**sizes, **{role: target for role, target in targets.items() if target is not None}}
            total = self.bounds.total
            if total is not None and sum(after.values()) > total:
                raise ScaleError(f"prefill {after['prefill']} + decode {after['decode']} = {sum(after.values())} "
                                 f"workers is beyond autoscale.max_workers ({total})")
            start = time.monotonic()
            result = ScaleResult(self.sizes())
            growing = sum(max(0, after[role] - sizes[role]) for role in ROLES)
            down_first = total is not None and len(self._workers()) + growing > total
            if down_first:
                self._shrink(targets, reason, result)
            for role, target in targets.items():
                while target is not None and self.sizes()[role] < target:
                    self._add(role, reason, result)
            if not down_first:
                self._shrink(targets, reason, result)
            result.sizes, result.seconds = self.sizes(), time.monotonic() - start
            return result

    def _workers(self) -> list[NamedWorker]:
        """Every worker of both pools, draining ones included (each holds its resources)."""
        return [w for role in ROLES for w in self.backend.pool(role)]

    def _shrink(self, targets: dict[str, int | None], reason: str, result: ScaleResult) -> None:
        leaving = {role: self._victims(role, target) for role, target in targets.items() if target is not None}
        names = [w for role in ROLES for w in leaving.get(role, [])]
        if names:
            logger.warning("scale-down (%s): draining %s (drain_timeout_s %g)", reason, ", ".join(names),
                           self.drain_timeout_s)
            result.moved = self._drain(leaving.get("decode", []), leaving.get("prefill", []))
            result.removed = names

    def _add(self, role: str, reason: str, result: ScaleResult) -> None:
        logger.warning("scale-up (%s): starting a %s worker", reason, role)
        try:
            worker = self.backend.add_worker(role)
        except Exception as exc:
            logger.error("scale-up (%s): a new %s worker did not start: %s", reason, role, exc)
            raise ScaleFailed(f"{role}: a new worker did not start: {exc}") from exc
        try:
            self.router.add_worker(role, worker.name, worker.address)
        except Exception as exc:  # a worker the router cannot know must not stay in the pool
            self._leave(worker.name, role, in_router=False)
            raise ScaleFailed(f"{role}: the router could not add {worker.name}: {exc}") from exc
        result.added.append(worker.name)
        logger.warning("scale-up (%s): %s serves at %s", reason, worker.name, worker.address)

    def _victims(self, role: str, target: int) -> list[str]:
        """The workers beyond `target`, not already draining: those the router sees
        down first (draining the live ones instead would leave requests nowhere to
        move, and the pool serving nothing until a restart), then the newest."""
        taking = [w for w in self.backend.pool(role) if not getattr(w, "draining", False)]
        excess = max(0, len(taking) - target)
        if not excess:
            return []
        down = {w.name for w in taking if not self.router.worker_live(w.name)}
        order = sorted(taking, key=lambda w: (w.name in down, _index(w)))
        return [w.name for w in order[len(taking) - excess:]]

    def _drain(self, decode: list[str], prefill: list[str]) -> int:
        """Drain them all at once; each leaves as soon as it is idle, or at the deadline.
        Returns the sequences moved off decode workers at the deadline. If a step
        fails, every worker still draining is taken out anyway (none is left draining
        for ever: taking no work, yet counted in its pool), then ScaleFailed."""
        pending = decode + prefill
        moved = 0
        try:
            for name in pending:
                self.router.drain_worker(name)
                self.backend.set_draining(name)
            deadline = time.monotonic() + self.drain_timeout_s
            while pending:
                for name in list(pending):
                    late = time.monotonic() >= deadline
                    if name in decode:
                        if self.router.requests_on(name) and not late:
                            continue
                        if late:
                            moved += self.router.evacuate(name)
                    else:
                        stats = self.router.worker_stats(name)
                        if stats is not None and stats.jobs and not late:
                            continue
                    self._leave(name, "decode" if name in decode else "prefill")
                    pending.remove(name)
                    logger.warning("scale-down: %s left%s", name, " at the drain deadline" if late else " drained")
                if pending:
                    time.sleep(self.poll_s)
        except Exception as exc:
            logger.exception("scale-down failed while draining %s; taking them out", ", ".join(pending))
            for name in pending:
                try:
                    if name in decode:
                        self.router.evacuate(name)
                    self._leave(name, "decode" if name in decode else "prefill")
                except Exception:  # noqa: BLE001 - the others still go
                    logger.exception("could not take %s out", name)
            raise ScaleFailed(f"scale-down failed while draining: {type(exc).__name__}: {exc}") from exc
        return moved

    def _leave(self, name: str, role: str, in_router: bool = True) -> None:
        """Out of the router and its pool: a decode worker leaves the router first (it
        sends it nothing more), a prefill worker its pool first (its decode peers drop
        it, falling back to local prefill)."""
        if role == "decode" and in_router:
            self.router.remove_worker(name)
        self.backend.remove_worker(name)
        if role == "prefill" and in_router:
            self.router.remove_worker(name)


def _index(worker: NamedWorker) -> int:
    tail = worker.name.rpartition("-")[2]
    return int(tail) if tail.isdigit() else 0
