"""Whether the router considers a decode worker alive (pure Python, no sockets).

The router pings every decode worker with `stats` each `router.health_interval_s`, and
counts *any* message from a worker (a token batch, a ping reply) as a sign of life: a
worker busy with a long step cannot answer a ping, but it answered the last one before
that step began, so only silence for `router.worker_timeout_s` declares it dead. Then
the router stops routing to it and fails its requests over (router/core.py); the next
message it sends re-admits it (a hung process that resumes; a restarted one, once its
supervisor has told the router its new address: cluster/ray/supervisor.py on Ray,
cluster/local/supervisor.py on one machine). The supervisor may also declare a worker
dead at once (`kill`), when it saw the process go. A worker dead by its silence alone
is `silent`: the local supervisor kills such a process (it may be hung, not gone), as
the Ray supervisor kills an actor that does not answer its probe.

A worker declared dead because it said it is `stalled` (`stall`) is different: it still
answers during its grace (workers/watchdog.py) and then exits, so its messages prove
nothing. Only a stats reply saying it is not stalled re-admits it (`heard(now,
stepping=True)`): its restarted process's, since a stalled one stays stalled for good.

Detection is bounded: a worker that dies is declared dead at most
worker_timeout_s + health_interval_s after its last message.

Who calls what: the router's reader task for a worker calls `heard()` on every message
it receives; the router's monitor task calls `expired()` once per interval. Both run on
one event loop, so there is no locking.
"""

from __future__ import annotations


class WorkerHealth:
    def __init__(self, timeout_s: float, now: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.last_heard = now  # a worker reported ready just before the router started
        self.alive = True
        # Dead by its silence alone: maybe hung (SIGSTOP, a wedged step) rather than
        # gone, so its supervisor kills it (a hung prefill worker holds decode workers'
        # KV blocks fenced for as long as it lives: kv_transfer/receiver.py).
        self.silent = False
        self.stalled = False  # dead because it said it is stalled: see stall()

    def heard(self, now: float, stepping: bool = False) -> bool:
        """A message arrived from the worker; `stepping`: a stats reply saying it is not
        stalled. True if that re-admits a dead worker (a stalled one: only `stepping`)."""
        self.last_heard = max(self.last_heard, now)
        if self.stalled and not stepping:
            return False
        revived = not self.alive
        self.alive, self.silent, self.stalled = True, False, False
        return revived

    def stall(self) -> bool:
        """It said it is stalled (it exits after its grace); True if it was alive."""
        self.stalled = True
        return self.kill()

    def kill(self) -> bool:
        """Declared dead from outside (a supervisor); True if it was alive."""
        was_alive, self.alive, self.silent = self.alive, False, False
        return was_alive

    def expired(self, now: float) -> bool:
        """True exactly once per death: when the worker, alive until now, has been
        silent for longer than timeout_s."""
        if self.alive and now - self.last_heard > self.timeout_s:
            self.alive, self.silent = False, True
            return True
        return False
