"""The router's one door for other threads: every call from outside its event loop
goes through `RouterControl` (Router.control), which hops onto the loop, since the
workers' sockets and the requests' inboxes live there.

Who calls what, from their own threads:
- a supervisor (cluster/local/supervisor.py, cluster/ray/supervisor.py, through
  cluster.launcher.RouterHooks): `worker_down`, `worker_moved`, `silent`, `worker_stays_down`;
- the scaler (cluster/elastic.py): `add_worker`, `drain_worker`, `requests_on`,
  `evacuate`, `remove_worker`, `worker_stats`, `worker_live`;
- the planner (cluster/autoscale/run.py): `snapshot`, `set_remote_prefill_min_tokens`.
The Router itself calls `attach` and `detach` on the loop as the app starts and stops.

The blocking verbs wait for the loop's answer (their timeout); before the app runs,
they run at once in the caller's thread (nothing else runs then), and a supervisor's
word waits for the app to start.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from protocol import WorkerStats
from router.load import LoadSnapshot, buckets_of, total_of, worker_load

if TYPE_CHECKING:
    from router.core import Router

T = TypeVar("T")


class RouterControl:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.pool = router.pool
        self._loop: asyncio.AbstractEventLoop | None = None  # set while the app runs
        self._early: list[Callable[[], Any]] = []  # a supervisor's words before it ran
        self._lock = threading.Lock()

    # --- the loop (the Router, on it) -----------------------------------------------------

    def attach(self) -> None:
        """On the app's event loop, as it starts: run the words that came before it."""
        with self._lock:
            self._loop = asyncio.get_running_loop()
            early, self._early = self._early, []
        for call in early:
            call()

    def detach(self) -> None:
        """As the app shuts down; calls wait for a next start, if any."""
        with self._lock:
            self._loop = None

    # --- a supervisor's words (they do not wait) ----------------------------------------

    def worker_down(self, name: str) -> None:
        """A decode or prefill worker is down; a decode worker's requests fail over."""
        def down() -> None:
            client = self.pool.find(name)
            if client is not None:  # else scaled away meanwhile
                client.declare_dead("is down (its supervisor saw it exit)")
        self._soon(down)

    def worker_stays_down(self, name: str, why: str) -> None:
        """The worker is down for good (its supervisor gave up restarting it): requests
        refused for want of it say so, and why, instead of "retry later"."""
        def stays_down() -> None:
            client = self.pool.find(name)
            if client is not None:
                client.declare_dead(why)
                client.down_reason = why  # also when it was already down
        self._soon(stays_down)

    def worker_moved(self, name: str, address: str) -> None:
        """Restarted at `address`, with an empty cache."""
        self._soon(lambda: self.pool.moved(name, address))

    def silent(self, timeout: float = 2.0) -> set[str]:
        """The workers of either pool the router declared dead for their silence alone
        (no supervisor said they exited, and they have not answered since): maybe hung."""
        return self.call(self.pool.silent, timeout)

    # --- the scaler's verbs -------------------------------------------------------------

    def add_worker(self, role: str, name: str, address: str, timeout: float = 30.0) -> None:
        """A new worker of `role` ("decode" | "prefill") serves at `address`, its peers
        told: route to it from now on."""
        self.call(lambda: self.pool.add(role, name, address), timeout)
        self.router.metrics.scale_events.labels(role=role, action="add").inc()

    def drain_worker(self, name: str, timeout: float = 30.0) -> None:
        """No new request goes to the worker (a decode worker's running ones go on)."""
        self.call(lambda: self.pool.drain(name), timeout)

    def requests_on(self, name: str, timeout: float = 30.0) -> int:
        """Sequences the router still awaits from a decode worker (0 for a prefill one)."""
        return self.call(lambda: self.pool.get(name).sequences_awaited, timeout)

    def evacuate(self, name: str, timeout: float = 30.0) -> int:
        """A draining decode worker's sequences still running move to the others by the
        failover path (each resubmitted as prompt + its tokens so far, its abort sent
        there); how many."""
        def move() -> int:
            client = self.pool.get(name)
            moving = client.sequences_awaited
            if moving:
                client.evacuate(f"was drained for {name}'s scale-down and its requests move")
            return moving
        return self.call(move, timeout)

    def remove_worker(self, name: str, timeout: float = 30.0) -> None:
        """The worker left its pool (stopped, or about to be): forget it."""
        role = self.call(lambda: self.pool.remove(name), timeout)
        self.router.metrics.scale_events.labels(role=role, action="remove").inc()

    def worker_stats(self, name: str, timeout: float = 5.0) -> WorkerStats | None:
        """A worker's stats reply, asked now (None: no answer, or the app is not running)."""
        if self._current() is None:
            return None
        client = self.call(lambda: self.pool.get(name), timeout)
        return self._await(client.stats(), timeout, "RouterControl.worker_stats")

    def worker_live(self, name: str, timeout: float = 30.0) -> bool:
        """Whether the router sees the worker alive (False for one it does not know)."""
        return self.call(lambda: (client := self.pool.find(name)) is not None and client.alive, timeout)

    # --- the planner's --------------------------------------------------------------------

    def snapshot(self, timeout: float = 10.0) -> LoadSnapshot:
        """The deployment's load now (load_snapshot); RuntimeError while the app is not
        running."""
        if self._current() is None:
            raise RuntimeError("the router is not serving yet")
        return self._await(self.load_snapshot(), timeout, "RouterControl.snapshot")

    def set_remote_prefill_min_tokens(self, value: int) -> None:
        """Move conditional disaggregation's threshold (the planner, when prefill is
        the bottleneck); requests submitted from now on use it."""
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"remote_prefill_min_tokens must be an integer >= 1, got {value!r}")
        self.router.remote_prefill_min_tokens = value
        self.router.metrics.remote_prefill_min_tokens.set(value)

    async def load_snapshot(self) -> LoadSnapshot:
        """On the loop: the router's counters and every worker's figures, asked now (2 s
        at most: a silent worker reads as zeros), router/load.py."""
        router, m = self.router, self.router.metrics
        pools = self.pool.listed()
        replies = await self.pool.stats_of([w for w, _ in pools])
        return LoadSnapshot(
            at=time.monotonic(), requests=total_of(m.requests), finished=total_of(m.finished),
            prompt_tokens=total_of(m.prompt_tokens), generation_tokens=total_of(m.generation_tokens),
            in_flight=router.in_flight, ttft=buckets_of(m.ttft), itl=buckets_of(m.itl), tpot=buckets_of(m.tpot),
            prompt_lengths=buckets_of(m.prompt_length),
            remote_prefill_min_tokens=router.remote_prefill_min_tokens,
            workers=tuple(worker_load(w.name, role, w.alive, w.draining, stats)
                          for (w, role), stats in zip(pools, replies)))

    # --- the hop ------------------------------------------------------------------------

    def call(self, fn: Callable[[], T], timeout: float = 30.0) -> T:
        """fn() on the router's event loop, and its result (or exception); run here
        when the app is not running (nothing else runs then)."""
        loop = self._current()
        if loop is None:
            return fn()
        if _on(loop):
            raise _blocks("RouterControl.call")
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
        loop.call_soon_threadsafe(run)
        return future.result(timeout)

    def _await(self, work: Coroutine[Any, Any, T], timeout: float, what: str) -> T:
        """A coroutine run on the loop, waited for here."""
        loop = self._current()
        if loop is None:
            work.close()
            raise RuntimeError("the router is not serving")
        if _on(loop):
            work.close()
            raise _blocks(what)
        return asyncio.run_coroutine_threadsafe(work, loop).result(timeout)

    def _soon(self, call: Callable[[], Any]) -> None:
        """Run `call` on the loop without waiting; before the app runs, when it starts."""
        with self._lock:
            if self._loop is None:
                self._early.append(call)
                return
            self._loop.call_soon_threadsafe(call)

    def _current(self) -> asyncio.AbstractEventLoop | None:
        with self._lock:
            return self._loop


def _on(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether this thread runs `loop`."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:  # no loop in this thread: the usual case
        return False


def _blocks(what: str) -> RuntimeError:
    """The blocking verbs wait for the loop: called on it, they would hold it (every
    request with it) until their timeout. Say so at once instead."""
    return RuntimeError(f"{what} blocks until the router's event loop runs it: call it from another thread "
                        "(asyncio.to_thread), never from the loop itself")
