"""The router's request path: take a parsed, tokenized request (router/parsing.py),
pick a decode worker (router/pool.py), ask it to prefill on a prefill worker when the
prompt is long enough (conditional disaggregation), and detokenize the worker's
per-step token batches incrementally, ending a request itself when a stop string
appears (each of a request's sequences apart: router/sequences.py). A decode worker
that falls silent is routed around, and its requests fail over to a live one
mid-stream (Router.run_batch, router/health.py). Other threads reach the router
through Router.control (router/control.py). The HTTP endpoints are router/app.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import zmq.asyncio

from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer
from protocol import Generate, to_wire
from router.adapters import Adapter
from router.admin import Scaling
from router.auth import KeyRing
from router.bounds import InputBounds
from router.config import ModelLimits, RouterSettings
from router.control import RouterControl
from router.errors import APIError
from router.metrics import RouterMetrics
from router.model_names import ServedModels
from router.parsing import RequestParser
from router.placement import Placement, RequestPlan
from router.pool import WorkerPool
from router.predictor import Ticket
from router.routing import RoutingPolicy
from router.sequences import MAX_RETRIES, Chunk, SequenceGroup, _rejection, admission
from router.slo import NO_TARGETS, Targets
from router.worker_client import WorkerClient
from security import DeploymentSecret

__all__ = ["MAX_RETRIES", "Chunk", "Router", "_rejection"]  # Chunk, and what tests import, from their old place


class Router:
    def __init__(self, config: RouterSettings, limits: ModelLimits, decode_workers: dict[str, str],
                 prefill_workers: dict[str, str] | None = None, secret: DeploymentSecret | None = None,
                 adapters: Mapping[str, str] = {}) -> None:
        """Workers by name -> ZMQ address. The router sends requests to decode workers
        only; it pings prefill workers too, for their health and /status. The launcher
        gives the router its settings, the decode workers' model limits
        (router/config.py), the deployment's secret, without which the workers refuse
        its sockets (None: workers that have none, in tests), and the LoRA adapters
        served from the start (name -> PEFT directory: router/adapters.py)."""
        self.config = config
        self.models = ServedModels.of(config.served_model_name, limits.model, limits.max_model_len,
                                      limits.max_lora_rank, adapters)
        self.model_name = self.models.name  # what responses carry
        self.max_model_len = limits.max_model_len
        self.block_size = limits.block_size
        self.metrics = RouterMetrics()
        # The router cannot see the pools' sizes; num_kv_blocks bounds the history it keeps.
        routing = RoutingPolicy(config.policy, limits.block_size, limits.num_kv_blocks or 65536)
        # The process's one asyncio context, never collected: a Router's own context,
        # collected together with its still-open sockets, would hang in its finalizer
        # (term() waits on sockets the collector has not closed yet).
        self.pool = WorkerPool(zmq.asyncio.Context.instance(), routing, self.metrics, config.worker_timeout_s,
                               limits.block_size, secret)
        self.parser = RequestParser(load_tokenizer(limits.model), limits, self.pool.kv_pool_tokens,
                                    InputBounds.of(config), self.models)
        # Conditional disaggregation's threshold: the config's, until the planner moves it.
        self.remote_prefill_min_tokens = config.remote_prefill_min_tokens
        self.metrics.remote_prefill_min_tokens.set(self.remote_prefill_min_tokens)
        self.in_flight = 0
        # SLO admission, fair queuing across keys and the latency predictor.
        self.placement = Placement(self.pool, self.metrics, config.slo, config.key_weights)
        ring = KeyRing(config.api_keys or ())
        self.key_labels = [ring.fingerprint(i) for i in range(len(ring))]  # the metrics' key label
        self._tasks: list[asyncio.Task] = []
        # Who grows and shrinks the pools (cluster/elastic.py sets it): the admin
        # endpoint's scale requests go to it; None: the pools are fixed.
        self.scaler: Scaling | None = None
        for role, pool in (("decode", decode_workers), ("prefill", prefill_workers or {})):
            for name, address in sorted(pool.items()):
                self.pool.add(role, name, address)
        self.control = RouterControl(self)  # every call from another thread

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer: requests are tokenized (self.parser), detokenized and
        their logprobs spelled with it."""
        return self.parser.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        self.parser.tokenizer = tokenizer

    # --- the app's lifetime (router/app.py) -------------------------------------------

    def start(self) -> None:
        """On the app's event loop, as it starts: run the calls other threads made before
        it, and read from every worker and supervise them until stop()."""
        self.control.attach()
        self.pool.start()
        self._tasks = [asyncio.create_task(self.pool.monitor(self.config.health_interval_s))]

    def stop(self) -> None:
        """As the app shuts down; calls from other threads wait for a next start, if any."""
        self.control.detach()
        self.pool.stop()
        for task in self._tasks:
            task.cancel()
        self._tasks = []

    # --- one request ----------------------------------------------------------------

    async def run(self, prompt: list[int], params: SamplingParams, priority: int = 0) -> AsyncGenerator[Chunk, None]:
        """One prompt's chunks (run_batch)."""
        async for chunk in self.run_batch([prompt], params, priority):
            yield chunk

    async def run_batch(self, prompts: list[list[int]], params: SamplingParams, priority: int = 0,
                        targets: Targets = NO_TARGETS, client: int | None = None,
                        received: float | None = None, lora: Adapter | None = None) -> AsyncGenerator[Chunk, None]:
        """The request's new text (and tokens, logprobs) after each worker step, for each
        of its params.n sequences per prompt (router/sequences.py), interleaved as they
        come. The first chunk is its admission (no text): it is checked and submitted.
        `priority`: its place in the decode workers' queues (lower first, then by its
        key's fair-queuing tag, then by arrival). `targets`: its SLOs (router/slo.py),
        against which it is admitted and placed (router/admission.py); `client`: its
        API key's position (fair queuing, per-key metrics); `received`: when the router
        took it (time.monotonic(); its TTFT target counts from there; None: now);
        `lora`: the LoRA adapter it runs with (None: the base model).

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
        if params.max_tokens <= 1 and targets.tpot_ms is not None:
            targets = dataclasses.replace(targets, tpot_ms=None)  # one token (or a prompt scored): no TPOT to miss
        plan = RequestPlan(priority, targets, client, time.monotonic() if received is None else received, lora)
        group = SequenceGroup(prompts, params, self.tokenizer, functools.partial(self._submit, plan=plan), m,
                              self.placement)
        group.start = plan.received
        try:
            # Every prompt placed (admitted) before any is sent: a refusal sends nothing.
            self.placement.admit(prompts, params.n, plan, self.remote_prefill_min_tokens,
                                 params.prompt_logprobs is not None)
            group.submit()
            m.requests.labels(prefill="remote" if group.seqs[0].remote else "local").inc()
            m.prompt_tokens.inc(sum(map(len, prompts)))
            for prompt in prompts:
                m.prompt_length.observe(len(prompt))
            yield admission(group)
            async for chunk in group.chunks():
                yield chunk
            key = self.key_labels[client] if client is not None and client < len(self.key_labels) else "none"
            self.placement.outcome(key, targets, *group.latencies())
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
            self.placement.cancel(plan)  # prompts admitted but never sent (an earlier one's send failed)
            group.close()

    def _submit(self, prompt: list[int], generated: list[int], params: SamplingParams,
                failover: bool, plan: RequestPlan) -> tuple[WorkerClient, str, bool, Ticket]:
        """Send prompt + generated to the decode worker the placement picks
        (router/placement.py), asking for what remains of params.max_tokens (for
        params.n sequences); the worker, the request's id there, whether it was asked
        to prefill on a prefill worker, and its ticket. The caller listens for its
        answers (no message is read before it returns: one event loop). Prompt
        logprobs need the prompt's logits, which a prefill worker does not send: such a
        prompt is prefilled on the decode worker (docs/architecture.md)."""
        tokens = prompt + generated
        if generated:
            n = len(generated)
            # Its prompt logprobs came with its first tokens already.
            params = dataclasses.replace(params, max_tokens=params.max_tokens - n,
                                         min_tokens=max(0, params.min_tokens - n), prompt_logprobs=None)
        if failover:
            placed = self.placement.place(tokens, params.n, plan, self.remote_prefill_min_tokens,
                                          params.prompt_logprobs is not None)
            self.metrics.failovers.inc()
        else:
            placed = plan.placed.pop(0)  # admitted (Placement.admit)
            self.metrics.cached_tokens.inc(placed.cached)
        request_id = uuid.uuid4().hex
        worker, sent = placed.worker, False
        try:
            sent = worker.send(Generate(request_id=request_id, prompt=tokens, params=to_wire(params),
                                        remote=placed.remote, priority=placed.priority, queue_tag=placed.tag,
                                        resumed=len(generated), lora=plan.lora.spec if plan.lora else None))
        finally:
            if not sent:  # nothing will answer for it: its ticket ends here
                for _ in range(params.n):
                    self.placement.ended(placed.ticket, None, None)
        if not sent:
            raise APIError(503, f"decode worker {worker.name} cannot be reached; retry later",
                           kind="service_unavailable")
        return worker, request_id, placed.remote, placed.ticket
