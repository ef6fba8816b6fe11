"""The planner's thread: every interval_s it takes a load snapshot, asks the planner
about the window since the snapshot window_s before, and applies what it decides
through callables the deployment gives it. It only decides and calls: adding and
removing workers is the scaler's (cluster/elastic.py), the threshold the router's.

A pass that raises is logged and the next one comes as usual: the planner must never
take the deployment down, nor stop planning because one stats reply was odd.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from cluster.autoscale.planner import Decision, Planner
from router.load import LoadSnapshot

logger = logging.getLogger("pdserve.autoscale")


class PlannerLoop:
    """Started by the deployment after its workers are up; stop() before they stop.

    snapshot:        the deployment's load now (router.load.LoadSnapshot); called on the loop's thread
    scale:           (pool, target, reason) -> None: resize a pool, blocking until done; a ValueError
                     (a size the bounds refuse, a scale already under way) is logged and skipped, a
                     RuntimeError (a worker that did not start) logged as an error; the pass goes on
    set_min_tokens:  the router's remote_prefill_min_tokens from now on
    record:          counts each decision (router.metrics' autoscale_decisions), whether or not it applied
    sizes:           workers taking work per pool; default: the snapshot's live, not draining ones
    """

    def __init__(self, planner: Planner, snapshot: Callable[[], LoadSnapshot],
                 scale: Callable[[str, int, str], None], set_min_tokens: Callable[[int], None],
                 record: Callable[[Decision], None], sizes: Callable[[], dict[str, int]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.planner = planner
        self._snapshot, self._scale, self._set_min_tokens, self._record = snapshot, scale, set_min_tokens, record
        self._sizes = sizes
        self._clock = clock
        self._history: deque[LoadSnapshot] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-planner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ends the loop: at once between passes; a scale call under way is waited for
        at most timeout_s (the thread is a daemon and does not hold the process)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        interval = self.planner.config.interval_s
        while not self._stop.is_set():
            started = self._clock()
            try:
                self.run_once()
            except Exception:
                logger.exception("autoscale: planning pass failed; trying again in %g s", interval)
            self._stop.wait(max(0.0, interval - (self._clock() - started)))

    def run_once(self) -> list[Decision]:
        """One pass: snapshot, decide, apply. Returns what was decided."""
        new = self._snapshot()
        old = self._window_start(new)
        sizes = self._sizes() if self._sizes else {pool: len(new.pool(pool)) for pool in ("prefill", "decode")}
        decisions = self.planner.decide(old, new, sizes, self._clock())
        for decision in decisions:
            if self._stop.is_set():
                break
            self._apply(decision)
        return decisions

    def _window_start(self, new: LoadSnapshot) -> LoadSnapshot:
        """The newest kept snapshot at least window_s older than new (the oldest while
        none is yet); older ones are dropped."""
        window = self.planner.config.window_s
        self._history.append(new)
        while len(self._history) > 1 and self._history[1].at <= new.at - window:
            self._history.popleft()
        return self._history[0]

    def _apply(self, decision: Decision) -> None:
        if decision.pool == "router":  # routing moves; a pool's size is what operators must see
            logger.info("autoscale: router.remote_prefill_min_tokens set to %d (%s): %s", decision.target,
                        decision.reason, decision.detail)
        else:
            logger.warning("autoscale: %s scale %s to %d (%s): %s", decision.pool, decision.action, decision.target,
                           decision.reason, decision.detail)
        try:
            if decision.pool == "router":
                self._set_min_tokens(decision.target)
            else:
                self._scale(decision.pool, decision.target, decision.reason)
                # Done: the pool's clocks, and the window, start now (the snapshots
                # kept so far were taken before the change served).
                self.planner.applied(decision.pool, self._clock())
                self._history.clear()
        except ValueError as exc:
            logger.warning("autoscale: %s %s to %d not applied: %s", decision.pool, decision.action,
                           decision.target, exc)
        except RuntimeError as exc:  # ScaleFailed: a worker did not start; the pass's other decisions still go
            logger.error("autoscale: %s %s to %d failed: %s", decision.pool, decision.action, decision.target, exc)
        finally:  # counted whatever became of it: the planner decided it
            self._record(decision)
