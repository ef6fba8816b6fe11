"""The router's request path: take a parsed, tokenized request (router/parsing.py),
pick a decode worker, ask it to prefill on a prefill worker when the prompt is long
enough (conditional disaggregation), and detokenize the worker's per-step token
batches incrementally, ending a request itself when a stop string appears (each of a
request's sequences apart: router/sequences.py). A decode worker that falls silent is
routed around, and its requests fail over to a live one mid-stream (Router.run_batch,
router/health.py). The HTTP endpoints are router/app.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import zmq.asyncio

from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer
from protocol import Generate, to_wire
from router.admin import Scaling
from router.bounds import InputBounds
from router.config import ModelLimits, RouterSettings
from router.errors import APIError
from router.load import LoadSnapshot, buckets_of, total_of, worker_load
from router.metrics import RouterMetrics
from router.model_names import ServedModels
from router.parsing import RequestParser
from router.routing import RoutingPolicy
from router.sequences import MAX_RETRIES, Chunk, SequenceGroup, _rejection, admission
from router.worker_client import WorkerClient
from security import DeploymentSecret

__all__ = ["MAX_RETRIES", "Chunk", "Router", "_rejection"]  # Chunk, and what tests import, from their old place

T = TypeVar("T")


class Router:
    def __init__(self, config: RouterSettings, limits: ModelLimits, decode_workers: dict[str, str],
                 prefill_workers: dict[str, str] | None = None, secret: DeploymentSecret | None = None) -> None:
        """Workers by name -> ZMQ address. The router sends requests to decode workers
        only; it pings prefill workers too, for their health and /status. The launcher
        gives the router its settings, the decode workers' model limits
        (router/config.py) and the deployment's secret, without which the workers
        refuse its sockets (None: workers that have none, in tests)."""
        self.config = config
        self.models = ServedModels.of(config.served_model_name, limits.model, limits.max_model_len)
        self.model_name = self.models.name  # what responses carry
        self.max_model_len = limits.max_model_len
        self.block_size = limits.block_size
        self.parser = RequestParser(load_tokenizer(limits.model), limits, self._kv_pool_tokens, InputBounds.of(config),
                                    self.models)
        # The process's one asyncio context, never collected: a Router's own context,
        # collected together with its still-open sockets, would hang in its finalizer
        # (term() waits on sockets the collector has not closed yet).
        self.ctx = zmq.asyncio.Context.instance()
        self.secret = secret
        self.workers: list[WorkerClient] = []  # the decode pool, in the routing policy's order
        self.prefill: list[WorkerClient] = []
        # The router cannot see the pools' sizes; this bounds the history it keeps.
        self.routing = RoutingPolicy(config.policy, 0, limits.block_size, limits.num_kv_blocks or 65536)
        self.metrics = RouterMetrics()
        # Conditional disaggregation's threshold: the config's, until the planner moves it.
        self.remote_prefill_min_tokens = config.remote_prefill_min_tokens
        self.metrics.remote_prefill_min_tokens.set(self.remote_prefill_min_tokens)
        self._readers: dict[str, asyncio.Task] = {}  # worker name -> its read_forever task
        self.in_flight = 0
        self.loop: asyncio.AbstractEventLoop | None = None  # set while the app runs
        self._early_calls: list[Any] = []  # from other threads before it ran
        self._calls_lock = threading.Lock()
        self._tasks: list[asyncio.Task] = []
        # Who grows and shrinks the pools (cluster/elastic.py sets it): the admin
        # endpoint's scale requests go to it; None: the pools are fixed.
        self.scaler: Scaling | None = None
        for role, pool in (("decode", decode_workers), ("prefill", prefill_workers or {})):
            for name, address in sorted(pool.items()):
                self._add_client(role, name, address)

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer: requests are tokenized (self.parser), detokenized and
        their logprobs spelled with it."""
        return self.parser.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        self.parser.tokenizer = tokenizer

    @property
    def max_token_chars(self) -> int:
        return self.parser.max_token_chars

    def _kv_pool_tokens(self) -> list[int]:
        """Tokens each decode worker's KV pool holds, of those whose stats reply said."""
        return [w.num_kv_blocks * self.block_size for w in self.workers if w.num_kv_blocks]

    # --- the app's lifetime (router/app.py) -------------------------------------------

    def start(self) -> None:
        """On the app's event loop, as it starts: run the calls that came before it, and
        read from every worker and supervise them until stop()."""
        with self._calls_lock:
            self.loop = asyncio.get_running_loop()
            early, self._early_calls = self._early_calls, []
        for call in early:
            call()
        self._readers = {w.name: asyncio.create_task(w.read_forever()) for w in self.workers + self.prefill}
        self._tasks = [asyncio.create_task(self.monitor())]

    def stop(self) -> None:
        """As the app shuts down; calls from other threads wait for a next start, if any."""
        with self._calls_lock:
            self.loop = None
        for task in [*self._tasks, *self._readers.values()]:
            task.cancel()
        self._tasks, self._readers = [], {}

    # --- one request ----------------------------------------------------------------

    async def run(self, prompt: list[int], params: SamplingParams, priority: int = 0) -> AsyncIterator[Chunk]:
        """One prompt's chunks (run_batch)."""
        async for chunk in self.run_batch([prompt], params, priority):
            yield chunk

    async def run_batch(self, prompts: list[list[int]], params: SamplingParams,
                        priority: int = 0) -> AsyncIterator[Chunk]:
        """The request's new text (and tokens, logprobs) after each worker step, for each
        of its params.n sequences per prompt (router/sequences.py), interleaved as they
        come. The first chunk is its admission (no text): it is checked and submitted.
        `priority`: its place in the decode workers' queues (lower first, then by arrival).

        Failover: when a sequence's decode worker is declared dead (router/health.py),
        the sequence is resubmitted alone to a live one as prompt + the tokens generated
        so far, with max_tokens and min_tokens reduced by as many and the same sampling
        params; the stream goes on from where it was. Greedy output continues token for
        token; seeded sampling and presence/frequency penalties restart their state on
        the new worker (the generated tokens count as prompt there), so such a sequence
        continues validly but not identically. With no live worker left it ends with
        HTTP 503 (before its first chunk) or a broken stream (after). A worker may also
        ask for a retry (Rejected.retry: a late KV write overwrote the sequence's
        blocks): it is resubmitted the same way, up to MAX_RETRIES times. A request a
        worker failed (its engine step failed, or the worker gave up) ends with HTTP
        500 or, after its first chunk, an error event; bad input with 400. A client
        gone (the generator closed) aborts every sequence still running."""
        if self.in_flight >= self.config.max_queued_requests:
            raise APIError(429, f"the server has {self.in_flight} requests in flight "
                                f"(max_queued_requests); retry later", kind="rate_limit_error")
        m = self.metrics
        self.in_flight += 1
        m.in_flight.set(self.in_flight)
        group = SequenceGroup(prompts, params, self.tokenizer, functools.partial(self._submit, priority=priority), m)
        try:
            group.submit()
            m.requests.labels(prefill="remote" if group.seqs[0].remote else "local").inc()
            m.prompt_tokens.inc(sum(map(len, prompts)))
            for prompt in prompts:
                m.prompt_length.observe(len(prompt))
            yield admission(group)
            async for chunk in group.chunks():
                yield chunk
        except Exception:
            # Before its first token, an error is the answer's status (the rejected
            # count); after, it ends an answer already under way.
            group.error = True
            if group.started:
                m.finished.labels(reason="error").inc()
            raise
        finally:
            self.in_flight -= 1
            m.in_flight.set(self.in_flight)
            group.close()

    def _submit(self, prompt: list[int], generated: list[int], params: SamplingParams,
                failover: bool, priority: int = 0) -> tuple[WorkerClient, str, bool]:
        """Send prompt + generated to a live decode worker, asking for what remains of
        params.max_tokens (for params.n sequences); the worker, the request's id there,
        and whether it was asked to prefill on a prefill worker. The caller listens for
        its answers (no message is read before it returns: one event loop)."""
        live = [w.alive and not w.draining for w in self.workers]
        if not any(live):
            raise self.no_live_worker()
        tokens = prompt + generated
        if generated:
            n = len(generated)
            # Its prompt logprobs came with its first tokens already.
            params = dataclasses.replace(params, max_tokens=params.max_tokens - n,
                                         min_tokens=max(0, params.min_tokens - n), prompt_logprobs=None)
        index, cached = self.routing.choose(tokens, [len(w.queues) for w in self.workers], live)
        worker, request_id = self.workers[index], uuid.uuid4().hex
        # Conditional disaggregation: only the part the worker must compute counts.
        # Prompt logprobs need the prompt's logits, which a prefill worker does not
        # send: such a prompt is prefilled on the decode worker (docs/architecture.md).
        remote = (len(tokens) - cached >= self.remote_prefill_min_tokens
                  and any(p.alive and not p.draining for p in self.prefill) and params.prompt_logprobs is None)
        if failover:
            self.metrics.failovers.inc()
        else:
            self.metrics.cached_tokens.inc(cached)
        if not worker.send(Generate(request_id=request_id, prompt=tokens, params=to_wire(params), remote=remote,
                                    priority=priority, resumed=len(generated))):
            raise APIError(503, f"decode worker {worker.name} cannot be reached; retry later",
                           kind="service_unavailable")
        return worker, request_id, remote

    def no_live_worker(self) -> APIError:
        why = "; ".join(f"{w.name} {'is being drained (scaled down)' if w.alive else w.down_reason}"
                        for w in self.workers)
        return APIError(503, f"no decode worker is alive ({why}); retry later", kind="service_unavailable")

    # --- from a supervisor's thread (cluster/ray/supervisor.py on Ray, cluster/local/supervisor.py) ---

    def worker_down(self, name: str) -> None:
        """A decode or prefill worker is down; a decode worker's requests fail over."""
        def down() -> None:
            client = self._find(name)
            if client is not None:  # else scaled away meanwhile
                client.declare_dead("is down (its supervisor saw it exit)")
        self._on_loop(down)

    def worker_moved(self, name: str, address: str) -> None:
        """Restarted at `address`, with an empty cache."""
        def move() -> None:
            client = self._find(name)
            if client is None:  # scaled away meanwhile
                return
            client.move(address)
            if client in self.workers:
                self.routing.forget(self.workers.index(client))
        self._on_loop(move)

    def _find(self, name: str) -> WorkerClient | None:
        return next((w for w in self.workers + self.prefill if w.name == name), None)

    def _client(self, name: str) -> WorkerClient:
        client = self._find(name)
        if client is None:
            raise LookupError(f"the router has no worker named {name}")
        return client

    def _on_loop(self, call: Any) -> None:
        """Run `call` on the router's event loop (its sockets and queues live there);
        before the app runs, when it starts."""
        with self._calls_lock:
            if self.loop is None:
                self._early_calls.append(call)
                return
            self.loop.call_soon_threadsafe(call)

    def publish_live(self) -> None:
        """Each worker's health, as the router sees it now, into the metrics."""
        self.metrics.set_live({w.name: w.alive for w in self.workers}, {w.name: w.alive for w in self.prefill})

    async def monitor(self) -> None:
        """Supervise the decode workers for the app's lifetime: ping each every
        router.health_interval_s, declare the silent ones dead (router/health.py)."""
        while True:
            for w in self.workers + self.prefill:
                w.ping()
            await asyncio.sleep(self.config.health_interval_s)
            for w in self.workers + self.prefill:
                w.check()
            self.publish_live()


    # --- elastic pools (cluster/elastic.py calls these from its thread) -----------------

    def _add_client(self, role: str, name: str, address: str) -> WorkerClient:
        """A client for a worker that serves now (its peers know it); on the loop, or
        before the app runs."""
        if self._find(name) is not None:
            raise ValueError(f"the router already has a worker named {name}")
        client = WorkerClient(self.ctx, name, address, self.config.worker_timeout_s, self.secret)
        if role == "decode":
            self.workers.append(client)
            self.routing.add()
            client.on_kv_events = lambda events, reset: self.routing.kv_events(self.workers.index(client), events,
                                                                               reset)
        else:
            self.prefill.append(client)
        if self.loop is not None:
            self._readers[name] = asyncio.create_task(client.read_forever())
        self._publish_pools()
        return client

    def add_worker(self, role: str, name: str, address: str, timeout: float = 30.0) -> None:
        """A new worker of `role` ("decode" | "prefill") serves at `address`, its peers
        told: route to it from now on."""
        self.call(lambda: self._add_client(role, name, address), timeout)
        self.metrics.scale_events.labels(role=role, action="add").inc()

    def drain_worker(self, name: str, timeout: float = 30.0) -> None:
        """No new request goes to the worker (a decode worker's running ones go on)."""
        def drain() -> None:
            self._client(name).draining = True
            self._publish_pools()
        self.call(drain, timeout)

    def requests_on(self, name: str, timeout: float = 30.0) -> int:
        """Sequences the router still awaits from a decode worker (0 for a prefill one)."""
        return self.call(lambda: _sequences_awaited(self._client(name)), timeout)

    def evacuate(self, name: str, timeout: float = 30.0) -> int:
        """A draining decode worker's sequences still running move to the others by the
        failover path (each resubmitted as prompt + its tokens so far, its abort sent
        here); how many."""
        def move() -> int:
            client = self._client(name)
            moving = _sequences_awaited(client)
            if moving:
                client.evacuate(f"was drained for {name}'s scale-down and its requests move")
            return moving
        return self.call(move, timeout)

    def remove_worker(self, name: str, timeout: float = 30.0) -> None:
        """The worker left its pool (stopped, or about to be): forget it."""
        def remove() -> str:
            client = self._client(name)
            role = "decode" if client in self.workers else "prefill"
            if role == "decode":
                index = self.workers.index(client)
                self.workers.pop(index)
                self.routing.remove(index)
            else:
                self.prefill.remove(client)
            reader = self._readers.pop(name, None)
            if reader is not None:
                reader.cancel()
            client.close()
            self.metrics.forget_worker(name, role)
            self._publish_pools()
            return role
        role = self.call(remove, timeout)
        self.metrics.scale_events.labels(role=role, action="remove").inc()

    def worker_stats(self, name: str, timeout: float = 5.0) -> dict[str, Any] | None:
        """A worker's stats reply, asked now from another thread (None: no answer, or
        the app is not running)."""
        with self._calls_lock:
            loop = self.loop
        if loop is None:
            return None
        client = self.call(lambda: self._client(name), timeout)
        return asyncio.run_coroutine_threadsafe(client.stats(), loop).result(timeout)

    def worker_live(self, name: str, timeout: float = 30.0) -> bool:
        """Whether the router sees the worker alive (False for one it does not know)."""
        return self.call(lambda: (client := self._find(name)) is not None and client.alive, timeout)

    def silent(self, timeout: float = 2.0) -> set[str]:
        """The workers of either pool the router declared dead for their silence alone
        (no supervisor said they exited, and they have not answered since): maybe hung."""
        return self.call(lambda: {w.name for w in self.workers + self.prefill if w.health.silent}, timeout)

    def set_remote_prefill_min_tokens(self, value: int) -> None:
        """Move conditional disaggregation's threshold (the planner, when prefill is
        the bottleneck); requests submitted from now on use it."""
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"remote_prefill_min_tokens must be an integer >= 1, got {value!r}")
        self.remote_prefill_min_tokens = value
        self.metrics.remote_prefill_min_tokens.set(value)

    def _publish_pools(self) -> None:
        for role, pool in (("decode", self.workers), ("prefill", self.prefill)):
            self.metrics.pool_workers.labels(role=role).set(sum(1 for w in pool if not w.draining))

    def call(self, fn: Callable[[], T], timeout: float = 30.0) -> T:
        """fn() on the router's event loop, from another thread, and its result (or
        exception); run here when the app is not running (nothing else runs then)."""
        with self._calls_lock:
            loop = self.loop
        if loop is None:
            return fn()
        _not_on(loop, "Router.call")
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
        loop.call_soon_threadsafe(run)
        return future.result(timeout)

    def snapshot(self, timeout: float = 10.0) -> LoadSnapshot:
        """load_snapshot() from another thread (the planner's); RuntimeError while the
        app is not running."""
        with self._calls_lock:
            loop = self.loop
        if loop is None:
            raise RuntimeError("the router is not serving yet")
        _not_on(loop, "Router.snapshot")
        return asyncio.run_coroutine_threadsafe(self.load_snapshot(), loop).result(timeout)

    async def load_snapshot(self) -> LoadSnapshot:
        """The deployment's load now (router/load.py): the router's counters and every
        worker's figures, asked now (2 s at most: a silent worker reads as zeros)."""
        m = self.metrics
        pools = [(w, "decode") for w in self.workers] + [(w, "prefill") for w in self.prefill]
        replies = await self.stats_of([w for w, _ in pools])
        return LoadSnapshot(
            at=time.monotonic(), requests=total_of(m.requests), finished=total_of(m.finished),
            prompt_tokens=total_of(m.prompt_tokens), generation_tokens=total_of(m.generation_tokens),
            in_flight=self.in_flight, ttft=buckets_of(m.ttft), itl=buckets_of(m.itl), tpot=buckets_of(m.tpot),
            prompt_lengths=buckets_of(m.prompt_length),
            remote_prefill_min_tokens=self.remote_prefill_min_tokens,
            workers=tuple(worker_load(w.name, role, w.alive, w.draining, stats)
                          for (w, role), stats in zip(pools, replies)))

    async def stats_of(self, clients: list[WorkerClient]) -> list[dict[str, Any] | None]:
        """Each worker's stats reply, asked now and side by side; None for one the
        router holds dead (it would only time out) or that did not answer in time."""
        return await asyncio.gather(*(w.stats() if w.alive else _nothing() for w in clients))


async def _nothing() -> None:
    return None


def _sequences_awaited(client: WorkerClient) -> int:
    """Sequences the router awaits from the worker (a parallel-sampling group's own
    entry, which only a rejection of the whole group would use, does not count)."""
    return sum(1 for q in client.queues.values() if getattr(q, "seq", True) is not None)


def _not_on(loop: asyncio.AbstractEventLoop, what: str) -> None:
    """The blocking verbs wait for the loop: called on it, they would hold it (every
    request with it) until their timeout. Say so at once instead."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:  # no loop in this thread: the usual case
        return
    if running is loop:
        raise RuntimeError(f"{what} blocks until the router's event loop runs it: call it from another thread "
                           "(asyncio.to_thread), never from the loop itself")
