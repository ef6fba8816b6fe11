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
import functools
import dataclasses
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

import zmq.asyncio

from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer
from protocol import Generate, to_wire
from router.bounds import InputBounds
from router.config import ModelLimits, RouterSettings
from router.errors import APIError
from router.metrics import RouterMetrics
from router.model_names import ServedModels
from router.parsing import RequestParser
from router.routing import RoutingPolicy
from router.sequences import MAX_RETRIES, Chunk, SequenceGroup, _rejection, admission
from router.worker_client import WorkerClient
from security import DeploymentSecret

__all__ = ["MAX_RETRIES", "Chunk", "Router", "_rejection"]  # Chunk, and what tests import, from their old place


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
        timeout = config.worker_timeout_s
        self.workers = [WorkerClient(self.ctx, n, a, timeout, secret) for n, a in sorted(decode_workers.items())]
        self.prefill = [WorkerClient(self.ctx, n, a, timeout, secret)
                        for n, a in sorted((prefill_workers or {}).items())]
        # The router cannot see the pools' sizes; this bounds the history it keeps.
        self.routing = RoutingPolicy(config.policy, len(self.workers), limits.block_size,
                                     limits.num_kv_blocks or 65536)
        for i, w in enumerate(self.workers):
            w.on_kv_events = lambda events, reset, i=i: self.routing.kv_events(i, events, reset)
        self.in_flight = 0
        self.metrics = RouterMetrics()
        self.loop: asyncio.AbstractEventLoop | None = None  # set while the app runs
        self._early_calls: list[Any] = []  # from other threads before it ran
        self._calls_lock = threading.Lock()
        self._tasks: list[asyncio.Task] = []

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
        self._tasks = [asyncio.create_task(w.read_forever()) for w in self.workers + self.prefill]
        self._tasks.append(asyncio.create_task(self.monitor()))

    def stop(self) -> None:
        """As the app shuts down; calls from other threads wait for a next start, if any."""
        with self._calls_lock:
            self.loop = None
        for task in self._tasks:
            task.cancel()
        self._tasks = []

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
        live = [w.alive for w in self.workers]
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
        remote = (len(tokens) - cached >= self.config.remote_prefill_min_tokens
                  and any(p.alive for p in self.prefill) and params.prompt_logprobs is None)
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
        why = "; ".join(f"{w.name} {w.down_reason}" for w in self.workers)
        return APIError(503, f"no decode worker is alive ({why}); retry later", kind="service_unavailable")

    # --- from a supervisor's thread (cluster/ray/supervisor.py on Ray, cluster/local/supervisor.py) ---

    def worker_down(self, name: str) -> None:
        """A decode or prefill worker is down; a decode worker's requests fail over."""
        self._on_loop(lambda: self._client(name).declare_dead("is down (its supervisor saw it exit)"))

    def worker_moved(self, name: str, address: str) -> None:
        """Restarted at `address`, with an empty cache."""
        def move() -> None:
            self._client(name).move(address)
            for i, w in enumerate(self.workers):
                if w.name == name:
                    self.routing.forget(i)
        self._on_loop(move)

    def _client(self, name: str) -> WorkerClient:
        return next(w for w in self.workers + self.prefill if w.name == name)

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

