"""Two watchdogs a worker loop keeps (workers/loop.py): one for a worker that
has work and makes no progress, one for a loop that does not come round at all."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class StallWatchdog:
    """Whether a worker that has work makes progress; pure (the caller passes the time).

    After every loop iteration the worker calls observe(now, pending, progressed):
    `pending` = its engine has work that a step could advance (decode: requests
    running or queued, not those waiting for pushed KV; prefill: prompts running or
    queued); `progressed` = since the last call a step computed tokens (a prompt chunk
    counts) or finished requests, or KV was written. The clock runs only while work is
    pending and nothing progresses; it restarts at any progress and whenever the worker
    is idle. A slow step that computes tokens is progress, however long it took.

    Once the clock reaches timeout_s the worker is stalled, for good (a restart is the
    cure): observe() returns True that once; must_exit() turns True grace_s later,
    which leaves the router time to read `stalled` in a stats reply and fail the
    worker's requests over before the process goes. timeout_s None or 0: never.
    """

    def __init__(self, timeout_s: float | None, grace_s: float, now: float) -> None:
        self.timeout_s = timeout_s or None
        self.grace_s = grace_s
        self.since = now  # start of the current stretch of pending work without progress
        self.pending = False
        self.stalled_at: float | None = None

    @property
    def stalled(self) -> bool:
        return self.stalled_at is not None

    def observe(self, now: float, pending: bool, progressed: bool) -> bool:
        """True exactly once: when the worker becomes stalled."""
        if self.stalled:
            return False  # frozen: the stretch that stalled it is what it reports
        if progressed or not pending:
            self.since = now
        self.pending = pending
        if self.timeout_s is not None and pending and now - self.since >= self.timeout_s:
            self.stalled_at = now
            return True
        return False

    def no_progress_s(self, now: float) -> float:
        """Seconds of pending work without progress (0 while idle or advancing)."""
        return max(0.0, now - self.since) if self.pending or self.stalled else 0.0

    def must_exit(self, now: float) -> bool:
        return self.stalled_at is not None and now - self.stalled_at >= self.grace_s


class HangWatchdog:
    """Ends the process when the worker loop has not come round for limit_s: a step
    that never returns (a hung kernel or collective, a deadlock) cannot notice itself.
    check() is pure (the caller passes the time and the loop's iteration count); the
    thread calls it every period_s. A period the thread overslept by far (the process
    was suspended, e.g. SIGSTOP) restarts the count: the loop had no chance to run.

    It runs in a Python thread: a C call that never releases the GIL would stop it too.
    The router still declares such a worker dead (router.worker_timeout_s)."""

    def __init__(self, limit_s: float, on_hang: Callable[[float], None], beat: Callable[[], int],
                 period_s: float | None = None) -> None:
        self.limit_s = limit_s
        self.on_hang = on_hang  # (seconds since the loop last came round); ends the process
        self.beat = beat
        self.period_s = period_s if period_s is not None else min(1.0, limit_s / 10)
        self._seen: int | None = None
        self._since = self._last = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-hang-watchdog", daemon=True)

    def check(self, now: float, beat: int) -> bool:
        """True when the loop has not come round (beat unchanged) for limit_s."""
        if beat != self._seen or now - self._last > 2 * self.period_s + 1.0:
            self._seen, self._since = beat, now
        self._last = now
        return now - self._since >= self.limit_s

    def start(self) -> None:
        self.check(time.monotonic(), self.beat())
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            now = time.monotonic()
            if self.check(now, self.beat()) and not self._stop.is_set():
                self.on_hang(now - self._since)
                return
