"""The OpenAI-compatible HTTP front end: /v1/completions, /v1/chat/completions (both
streamed as server-sent events, or not), /v1/models and /health.

The router tokenizes (and applies the chat template), picks a decode worker, asks it
to prefill on a prefill worker when the prompt is long enough (conditional
disaggregation), and detokenizes the worker's per-step token batches incrementally,
ending a request itself when a stop string appears. Bad input is HTTP 400 with an
OpenAI-style error naming the problem; a full queue is HTTP 429 with Retry-After.
A decode worker that falls silent is routed around, and its requests fail over to a
live one mid-stream (Router.run, router/health.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from cluster.config import ClusterConfig
from engine.engine_core import EngineCore
from engine.llm import load_tokenizer
from engine.model.config import ModelConfig
from engine.sampling_params import SamplingParams
from router import request_body
from router.detokenizer import Detokenizer
from router.worker_client import WORKER_LOST, WorkerClient
from router.errors import APIError
from router.logprobs import LogprobFormatter, merge
from router.metrics import RouterMetrics
from router.request_body import SAMPLING_FIELDS
from router.routing import RoutingPolicy

logger = logging.getLogger(__name__)
# Names the decode worker serving a response (for a stream: the one that began it;
# otherwise the one that finished it), for operators and the failover test.
WORKER_HEADER = "x-pdserve-decode-worker"


@dataclass
class Chunk:
    """What one worker step added to a request, detokenized."""

    text: str
    finish_reason: str | None
    num_tokens: int  # output tokens so far
    token_ids: list[int] = field(default_factory=list)  # this step's
    logprobs: list[list] = field(default_factory=list)  # per token of this step, when asked
    worker: str = ""  # the decode worker that sent it (another after a failover)


class Router:
    def __init__(self, config: ClusterConfig, decode_workers: dict[str, str],
                 prefill_workers: dict[str, str] | None = None) -> None:
        """Workers by name -> ZMQ address. The router sends requests to decode workers
        only; it pings prefill workers too, for their health and /status."""
        self.config = config
        self.model_name = config.model
        self.served_names = {config.model, Path(config.model).name}
        self.tokenizer = load_tokenizer(config.model)
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        # The longest vocabulary entry: its spelling has at least one character per
        # character of text it stands for (byte-level BPE: one per byte), so this
        # bounds how many characters max_model_len tokens can hold.
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1)
        engine = config.engine_config("decode")
        model_config = ModelConfig.from_model_dir(config.model)
        self.vocab_size = model_config.vocab_size
        # The decode workers' context length, computed as their engines do.
        self.max_model_len = EngineCore._max_model_len(engine, model_config)
        self.ctx = zmq.asyncio.Context()
        timeout = config.router.worker_timeout_s
        self.workers = [WorkerClient(self.ctx, n, a, timeout) for n, a in sorted(decode_workers.items())]
        self.prefill = [WorkerClient(self.ctx, n, a, timeout) for n, a in sorted((prefill_workers or {}).items())]
        # The router cannot see the pools' sizes; this bounds the history it keeps.
        self.routing = RoutingPolicy(config.router.policy, len(self.workers), engine.block_size,
                                     engine.num_kv_blocks or 65536)
        for i, w in enumerate(self.workers):
            w.on_kv_events = lambda events, reset, i=i: self.routing.kv_events(i, events, reset)
        self.in_flight = 0
        self.metrics = RouterMetrics()
        self.loop: asyncio.AbstractEventLoop | None = None  # set while the app runs
        self._early_calls: list[Any] = []  # from other threads before it ran
        self._calls_lock = threading.Lock()

    # --- request parsing ----------------------------------------------------------

    def sampling_params(self, body: dict[str, Any], chat: bool, num_prompt_tokens: int,
                        prompt_field: str) -> SamplingParams:
        """The request's SamplingParams, checked against the context length here (the
        decode worker checks again) so the error can name the field. Chat without
        max_tokens generates until EOS or a full context, as vLLM does; completions
        keep OpenAI's default of 16."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise APIError(400, f"prompt has {num_prompt_tokens} tokens, but the model's context length is "
                                f"{self.max_model_len} (prompt must leave room for output)", prompt_field)
        params = request_body.sampling_params(body, chat, room if chat else None)
        if params.max_tokens > room:
            alias = body.get("max_tokens") is None and body.get(request_body.MAX_TOKENS_ALIAS) is not None
            name = request_body.MAX_TOKENS_ALIAS if alias else "max_tokens"
            raise APIError(400, f"prompt ({num_prompt_tokens} tokens) + {name} ({params.max_tokens}) = "
                                f"{num_prompt_tokens + params.max_tokens} exceeds the model's context length "
                                f"{self.max_model_len}", name)
        return params

    async def prompt_ids(self, prompt: Any) -> list[int]:
        prompt = request_body.prompt_input(prompt, self.vocab_size)
        if isinstance(prompt, list):
            return prompt
        self._check_chars(len(prompt), "prompt")
        return await self._tokenize(self.tokenizer.encode, prompt)

    async def chat_ids(self, body: dict[str, Any]) -> list[int]:
        messages = request_body.chat_messages(body.get("messages"))
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        add_generation_prompt = request_body.flag(body, "add_generation_prompt", True)

        def tokenize() -> list[int]:
            # Rendered to text, then encoded without special tokens: the template
            # already holds them (as LLM.chat does).
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return await self._tokenize(tokenize)

    def _check_chars(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing it, text that cannot fit the context: no token of
        this vocabulary covers more than max_token_chars characters, so such text has
        more than max_model_len tokens. Tokenizing megabytes would only take seconds to
        find that out."""
        limit = self.max_model_len * self.max_token_chars
        if num_chars > limit:
            raise APIError(400, f"{param} has {num_chars} characters: more than the model's context length "
                                f"({self.max_model_len} tokens) can hold (at most {limit} characters)", param)

    async def _tokenize(self, call: Callable[..., list[int]], *args: Any) -> list[int]:
        """Run a tokenizer call off the event loop, so that streams, health pings and
        /health go on meanwhile (the fast tokenizer releases the GIL). One thread:
        tokenizer calls never run concurrently (HF fast tokenizers are not safe for
        that), and the character cap bounds how long one call may take."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, call, *args)

    # --- one request ----------------------------------------------------------------

    async def run(self, prompt: list[int], params: SamplingParams) -> AsyncIterator[Chunk]:
        """The request's new text (and tokens, logprobs) after each worker step.

        Failover: when its decode worker is declared dead (router/health.py), the
        request is resubmitted to a live one as prompt + the tokens generated so far,
        with max_tokens and min_tokens reduced by as many and the same sampling
        params; the stream goes on from where it was. Greedy output continues token for
        token; seeded sampling and presence/frequency penalties restart their state on
        the new worker (the generated tokens count as prompt there), so such a request
        continues validly but not identically. With no live worker left it ends with
        HTTP 503 (before its first chunk) or a broken stream (after)."""
        if self.in_flight >= self.config.router.max_queued_requests:
            raise APIError(429, f"the server has {self.in_flight} requests in flight "
                                f"(max_queued_requests); retry later", kind="rate_limit_error")
        m = self.metrics
        self.in_flight += 1
        m.in_flight.set(self.in_flight)
        detok = Detokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output)
        worker: WorkerClient | None = None
        request_id = ""
        finished = False
        start = last = time.monotonic()
        try:
            while not finished:
                if worker is not None:  # its worker died: leave it, resubmit elsewhere
                    worker.queues.pop(request_id, None)
                    worker.send("abort", id=request_id)  # in case it was only slow
                    if params.max_tokens - detok.num_tokens < 1:  # cannot happen: the last batch says finished
                        finished = True
                        yield Chunk(detok.flush(), "length", detok.num_tokens, worker=worker.name)
                        break
                worker, request_id, queue = self._submit(prompt, detok.ids, params, failover=worker is not None)
                while not finished:
                    msg = await queue.get()
                    if msg is WORKER_LOST:
                        break
                    if msg["kind"] == "rejected":
                        finished = True  # nothing to abort: the worker never queued it
                        raise APIError(400, msg["error"])
                    now, new = time.monotonic(), len(msg["tokens"])
                    if new and detok.num_tokens == 0:
                        m.ttft.observe(now - start)
                    elif new:  # a batch of tokens from one step: each waited its share
                        for _ in range(new):
                            m.itl.observe((now - last) / new)
                    if new:
                        last = now
                        m.generation_tokens.inc(new)
                    delta, stopped = detok.add(msg["tokens"])
                    finished = msg["finished"] or stopped
                    reason = "stop" if stopped else (msg["reason"] if msg["finished"] else None)
                    if finished:
                        delta += detok.flush()
                        m.e2e.observe(time.monotonic() - start)
                        m.finished.labels(reason=reason).inc()
                        m.observe_phases(msg["phases"])
                        m.prefix_cached_tokens.inc(msg["cached"])
                    yield Chunk(delta, reason, detok.num_tokens, msg["tokens"], msg["logprobs"], worker.name)
        finally:
            self.in_flight -= 1
            m.in_flight.set(self.in_flight)
            if worker is not None:
                worker.queues.pop(request_id, None)
                if not finished:  # the client went away: free the worker's blocks
                    m.finished.labels(reason="abort").inc()
                    worker.send("abort", id=request_id)
                elif detok.stopped:
                    worker.send("abort", id=request_id)

    def _submit(self, prompt: list[int], generated: list[int], params: SamplingParams,
                failover: bool) -> tuple[WorkerClient, str, asyncio.Queue]:
        """Send prompt + generated to a live decode worker, asking for what remains of
        params.max_tokens; the worker, the request's id there, and its message queue."""
        live = [w.alive for w in self.workers]
        if not any(live):
            raise self.no_live_worker()
        tokens = prompt + generated
        if generated:
            n = len(generated)
            params = dataclasses.replace(params, max_tokens=params.max_tokens - n,
                                         min_tokens=max(0, params.min_tokens - n))
        index, cached = self.routing.choose(tokens, [len(w.queues) for w in self.workers], live)
        worker, request_id = self.workers[index], uuid.uuid4().hex
        # Conditional disaggregation: only the part the worker must compute counts.
        remote = (len(tokens) - cached >= self.config.router.remote_prefill_min_tokens
                  and any(p.alive for p in self.prefill))
        m = self.metrics
        if failover:
            m.failovers.inc()
        else:
            m.requests.labels(prefill="remote" if remote else "local").inc()
            m.prompt_tokens.inc(len(prompt))
            m.cached_tokens.inc(cached)
        if not worker.send("generate", id=request_id, prompt=tokens, params=_params_dict(params),
                           remote=remote, priority=0):
            raise APIError(503, f"decode worker {worker.name} cannot be reached; retry later",
                           kind="service_unavailable")
        queue: asyncio.Queue = asyncio.Queue()
        worker.queues[request_id] = queue
        return worker, request_id, queue

    def no_live_worker(self) -> APIError:
        return APIError(503, f"no decode worker is alive (all {len(self.workers)} silent for more than "
                             f"router.worker_timeout_s); retry later", kind="service_unavailable")

    # --- from the Ray supervisor's thread (cluster/supervisor.py) ---------------------

    def worker_down(self, name: str) -> None:
        """A decode or prefill worker is down; a decode worker's requests fail over."""
        self._on_loop(lambda: self._client(name).declare_dead("is down (Ray supervisor)"))

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
            await asyncio.sleep(self.config.router.health_interval_s)
            for w in self.workers + self.prefill:
                w.check()
            self.publish_live()


def _params_dict(params: SamplingParams) -> dict[str, Any]:
    return {k: getattr(params, k) for k in (*SAMPLING_FIELDS, "logprobs")}


def _error_body(exc: APIError) -> dict[str, Any]:
    return {"error": {"message": exc.message, "type": exc.kind, "param": exc.param, "code": exc.status}}


def _error(exc: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    return JSONResponse(_error_body(exc), status_code=exc.status, headers=headers)


def create_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        with router._calls_lock:
            router.loop = asyncio.get_running_loop()
            early, router._early_calls = router._early_calls, []
        for call in early:
            call()
        tasks = [asyncio.create_task(w.read_forever()) for w in router.workers + router.prefill]
        tasks.append(asyncio.create_task(router.monitor()))
        yield
        with router._calls_lock:
            router.loop = None  # later calls wait for a next start, if any
        for task in tasks:
            task.cancel()

    app = FastAPI(title="pdserve", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        router.metrics.rejected.labels(status=str(exc.status)).inc()
        return _error(exc)

    async def body_of(request: Request, chat: bool) -> dict[str, Any]:
        """The request's JSON body, with every check that needs no tokenizer done."""
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        request_body.check_model(body, router.served_names, router.model_name)
        request_body.check_unsupported(body, chat)
        request_body.flag(body, "stream", False)
        request_body.include_usage(body)
        return body

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while some decode worker is live; else 503, so that a load balancer or
        a readiness probe sees that this deployment can serve nothing."""
        if not any(w.alive for w in router.workers):
            return _error(router.no_live_worker())
        return JSONResponse({"status": "ok"})

    @app.get("/status")
    async def status() -> dict[str, Any]:
        """Every worker of both pools: live or not, and its own figures (None if it did
        not answer); `pdserve status` prints this."""
        pools = router.workers + router.prefill
        replies = await asyncio.gather(*(w.stats() if w.alive else _none() for w in pools))
        rows = [{"name": w.name, "address": w.address, "live": w.alive, "stats": s} for w, s in zip(pools, replies)]
        return {"model": router.model_name, "in_flight": router.in_flight, "prefill_pool": bool(router.prefill),
                "decode_workers": rows[:len(router.workers)], "prefill_workers": rows[len(router.workers):]}

    @app.get("/metrics")
    async def metrics() -> Response:
        live = [w for w in router.workers if w.alive]  # a dead one would only time out
        for worker, stats in zip(live, await asyncio.gather(*(w.stats() for w in live))):
            if stats is not None:
                router.metrics.set_worker(worker.name, stats)
        router.publish_live()
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": router.model_name, "object": "model",
                                            "created": 0, "owned_by": "pdserve"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await body_of(request, chat=False)
        prompt = await router.prompt_ids(body.get("prompt"))
        params = router.sampling_params(body, False, len(prompt), "prompt")
        return await respond(request, body, prompt, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await body_of(request, chat=True)
        prompt = await router.chat_ids(body)
        params = router.sampling_params(body, True, len(prompt), "messages")
        return await respond(request, body, prompt, params, chat=True)

    async def respond(request: Request, body: dict[str, Any], prompt: list[int], params: SamplingParams,
                      chat: bool) -> Any:
        stream = router.run(prompt, params)
        formatter = LogprobFormatter(router.tokenizer, chat) if params.logprobs is not None else None

        def logprobs_of(chunk: Chunk) -> dict[str, Any] | None:
            return formatter.format(chunk.token_ids, chunk.logprobs) if formatter else None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def usage(n: int) -> dict[str, int]:
            return {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}

        def choice(text: str, reason: str | None, delta: bool, logprobs: dict[str, Any] | None) -> dict[str, Any]:
            if not chat:
                return {"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}
            key = "delta" if delta else "message"
            return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": reason,
                    "logprobs": logprobs}

        if not request_body.flag(body, "stream", False):
            chunks = await _all_unless_disconnected(request, stream)
            if chunks is None:  # nobody is left to read an answer (499: nginx's "client closed")
                return Response(status_code=499)
            parts = [p for p in map(logprobs_of, chunks) if p is not None]
            last = chunks[-1]
            return JSONResponse({"id": rid, "object": kind, "created": created, "model": router.model_name,
                                 "choices": [choice("".join(c.text for c in chunks), last.finish_reason, False,
                                                    merge(parts))],
                                 "usage": usage(last.num_tokens)},
                                headers={WORKER_HEADER: last.worker})

        first = await anext(stream)  # errors (400, 429) surface before any byte is sent
        include_usage = request_body.include_usage(body)

        async def events() -> AsyncIterator[str]:
            chunk_kind = "chat.completion.chunk" if chat else "text_completion"
            n = first.num_tokens

            async def chunks() -> AsyncIterator[Chunk]:
                yield first
                async for chunk in stream:
                    yield chunk

            try:
                async for chunk in chunks():
                    n = chunk.num_tokens
                    yield _sse(rid, chunk_kind, created, router.model_name,
                               choice(chunk.text, chunk.finish_reason, True, logprobs_of(chunk)))
                if include_usage:
                    yield "data: " + json.dumps({"id": rid, "object": chunk_kind, "created": created,
                                                 "model": router.model_name, "choices": [],
                                                 "usage": usage(n)}) + "\n\n"
            except Exception as exc:  # noqa: BLE001 - the status line is sent: say it in the stream
                yield _error_event(router, exc)
            finally:
                await stream.aclose()  # a client gone mid-stream aborts the request
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={WORKER_HEADER: first.worker})

    return app


async def _none() -> None:
    return None


async def _all_unless_disconnected(request: Request, stream: AsyncIterator[Chunk]) -> list[Chunk] | None:
    """Every chunk of a non-streamed request; None if its client hangs up first. Then
    the request is aborted (Router.run's cleanup), freeing its KV blocks on the
    worker, rather than generated to the end for nobody."""
    async def collect() -> list[Chunk]:
        return [chunk async for chunk in stream]

    async def disconnected() -> None:
        # The body has been read, so the next ASGI message is the disconnect (or
        # comes only once the response is complete, when this is cancelled).
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()  # raises CancelledError inside run(): its finally aborts the request
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        return None
    return work.result()  # raises the request's own error (400, 429, 503)


def _error_event(router: Router, exc: Exception) -> str:
    """The SSE event that ends a stream broken after its first chunk (e.g. its decode
    worker died with no live one to fail over to), as vLLM sends one."""
    if not isinstance(exc, APIError):
        logger.exception("a stream failed", exc_info=exc)
        exc = APIError(500, f"internal error: {type(exc).__name__}: {exc}", kind="internal_server_error")
    router.metrics.rejected.labels(status=str(exc.status)).inc()
    return "data: " + json.dumps(_error_body(exc)) + "\n\n"


def _sse(rid: str, kind: str, created: int, model: str, choice: dict[str, Any]) -> str:
    return "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": model,
                                  "choices": [choice]}) + "\n\n"
