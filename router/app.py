"""The OpenAI-compatible HTTP front end: /v1/completions, /v1/chat/completions (both
streamed as server-sent events, or not), /v1/models, /tokenize, /detokenize, /version,
/health, /metrics and /status (docs/api.md). Each endpoint is one small function: a
body is parsed once into a typed request (router/parsing.py), run by the Router
(router/core.py), and its response shaped by router/responses.py.

Bad input is HTTP 400 with an OpenAI-style error naming the field; an unknown model or
route 404 and a wrong method 405, in the same shape; a full queue is HTTP 429 with
Retry-After; no live decode worker is 503. Every GET endpoint answers HEAD too. API
keys, the per-key request rate and the body's size and arrival time are checked before
any endpoint runs (router/http_guard.py); a key's tokens in flight once its request is
parsed. Every request's outcome goes to the access log (router/access_log.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from protocol import WorkerStats
from router import adapters, admin, slo, structured, tokenize_api
from router.access_log import AccessLog, refused, track
from router.adapters import LOAD_LORA, UNLOAD_LORA
from router.auth import KeyRing
from router.core import Chunk, Router
from router.errors import APIError, TokenizerBusy
from router.http_guard import HTTPGuard, client_of
from router.limits import Limits
from router.logprobs import LogprobFormatter, echoed
from router.parsing import ChatRequest, CompletionRequest, GenerateRequest
from router.predictor import RECENT
from router.responses import DONE_EVENT, ResponseShaper, error_event, error_response
from router.tool_calls import ToolCallStream
from router.version import pdserve_version
from router.worker_client import WorkerClient

__all__ = ["Router", "WORKER_HEADER", "create_app"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Names the decode worker serving a response (for a stream: the one that began it;
# otherwise the one that finished it), for operators and the failover test.
WORKER_HEADER = "x-pdserve-decode-worker"


def create_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        router.start()
        yield
        router.stop()

    # No redirect from "/x/" to "/x": its Location would come from the client's Host
    # header; any other path is a 404 like every unknown route.
    app = FastAPI(title="pdserve", lifespan=lifespan, redirect_slashes=False)
    app.state.router = router
    app.state.limits = limits = Limits(router.config)
    app.add_middleware(HTTPGuard, keys=KeyRing(router.config.api_keys or ()), limits=limits,
                       settings=router.config, rejected=lambda status: router.metrics.rejected.labels(
                           status=str(status)).inc(),
                       admin_keys=KeyRing(router.config.admin_keys or (), kind="admin key"))
    if router.config.access_log:  # added last: outside the guard, whose answers it logs too
        app.add_middleware(AccessLog, keys=KeyRing(router.config.api_keys or ()))
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    for path, endpoint in (("/health", health), ("/status", status), ("/metrics", metrics), ("/version", version),
                           ("/v1/models", models), ("/v1/models/{model:path}", model)):
        app.add_api_route(path, endpoint, methods=["GET"])
        # HEAD as GET, without the body (load balancers probe /health so); one route
        # per method keeps the OpenAPI schema's operation ids unique.
        app.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/admin/pools", admin_pools, methods=["GET"])
    app.add_api_route("/admin/pools", admin_pools, methods=["HEAD"], include_in_schema=False)
    app.add_api_route("/admin/scale", admin_scale, methods=["POST"])
    app.add_api_route(LOAD_LORA, load_lora_adapter, methods=["POST"])
    app.add_api_route(UNLOAD_LORA, unload_lora_adapter, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    return app


def _router(request: Request) -> Router:
    return request.app.state.router


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    _router(request).metrics.rejected.labels(status=str(exc.status)).inc()
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404 (no such route) and 405 (not this method), in the OpenAI
    error shape rather than FastAPI's {"detail": ...}."""
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        error = APIError(404, f"Invalid URL ({where}): no such endpoint")
    elif exc.status_code == 405:
        headers = dict(exc.headers or {})
        methods = [m.strip() for m in headers.get("Allow", "").split(",") if m.strip()]
        if "GET" in methods and "HEAD" not in methods:  # its HEAD is a route of its own
            methods.append("HEAD")
        headers["Allow"] = allowed = ", ".join(methods)
        error = APIError(405, f"Method not allowed ({where}); this endpoint takes {allowed}", headers=headers)
    else:
        error = APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
    return await _api_error(request, error)


async def health(request: Request) -> JSONResponse:
    """200 while some decode worker is live and takes new requests (not draining); else
    503, so that a load balancer or a readiness probe sees that this deployment can
    serve nothing new."""
    router = _router(request)
    if not router.pool.serving():
        return error_response(router.pool.no_live_worker())
    return JSONResponse({"status": "ok"})


async def status(request: Request) -> dict[str, Any]:
    """Every worker of both pools: live or not, and its own figures; `pdserve status`
    prints this. A worker that does not answer now (a CPU step can outlast the wait, a
    dead worker is not asked) shows its latest reply's figures with their age in
    `stats_age_s` (0 for a reply to this request), or null if it never answered.
    `?prediction_window=N`: the SLO prediction error over the last N predictions only
    (a benchmark's run)."""
    router = _router(request)
    window = _prediction_window(request.query_params.get("prediction_window"))
    pools = router.pool.listed()  # as listed: a scale may change them
    replies = await router.pool.stats_of([w for w, _ in pools])
    now = time.monotonic()

    def row(w: WorkerClient, fresh: WorkerStats | None) -> dict[str, Any]:
        heard, stats = (now, fresh) if fresh is not None else (w.latest_stats or (now, None))
        # A WorkerStats as JSON: its fields, without those of the other role (protocol/stats.py).
        return {"name": w.name, "address": w.address, "live": w.alive, "draining": w.draining,
                "stats": msgspec.to_builtins(stats), "stats_age_s": None if stats is None else round(now - heard, 3)}
    rows = [(row(w, s), role) for (w, role), s in zip(pools, replies)]
    return {"model": router.model_name, "in_flight": router.in_flight, "prefill_pool": bool(router.pool.prefill),
            "slo": {"policy": router.placement.policy,
                    "prediction_error": router.placement.predictor.error_quantiles(window)},
            "decode_workers": [r for r, role in rows if role == "decode"],
            "prefill_workers": [r for r, role in rows if role == "prefill"]}


def _prediction_window(text: str | None) -> int | None:
    if text is None:
        return None
    if not re.fullmatch(r"[0-9]{1,4}", text) or not 1 <= int(text) <= RECENT:
        raise APIError(400, f"prediction_window must be a whole number in [1, {RECENT}], got {text[:40]!r}",
                       "prediction_window")
    return int(text)


async def metrics(request: Request) -> Response:
    """The router's own metrics, and every live worker's figures of both pools, asked
    now (a dead one would only time out), labelled by worker and role."""
    router = _router(request)
    live = [(w, role) for w, role in router.pool.listed() if w.alive]
    for (worker, role), stats in zip(live, await asyncio.gather(*(w.stats() for w, _ in live))):
        if stats is not None and not worker.closed:  # one scaled away meanwhile stays forgotten
            router.metrics.set_worker(worker.name, role, stats)
    router.pool.publish_live()
    return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def admin_pools(request: Request) -> dict[str, Any]:
    """Each pool's workers taking work, and every worker with its state (admin key)."""
    router = _router(request)
    workers = [{"name": w.name, "role": role, "address": w.address, "live": w.alive, "draining": w.draining}
               for w, role in router.pool.listed()]
    sizes = {role: sum(1 for w in workers if w["role"] == role and not w["draining"]) for role in ("prefill", "decode")}
    return {**sizes, "scalable": router.scaler is not None, "workers": workers,
            "remote_prefill_min_tokens": router.remote_prefill_min_tokens}


async def admin_scale(request: Request) -> dict[str, Any]:
    """Scale the pools (admin key): {"prefill": N, "decode": M}, either or both."""
    router = _router(request)
    return await admin.scale(router.scaler, await request.body())


async def load_lora_adapter(request: Request) -> PlainTextResponse:
    """Serve a LoRA adapter from now on (admin key): {"lora_name", "lora_path"}, as vLLM's."""
    return PlainTextResponse(await adapters.load_endpoint(_router(request).models.adapters, await request.body()))


async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    """Stop serving a LoRA adapter (admin key): {"lora_name"}."""
    return PlainTextResponse(adapters.unload_endpoint(_router(request).models.adapters, await request.body()))


async def models(request: Request) -> dict[str, Any]:
    return _router(request).models.listing()


async def model(request: Request, model: str) -> dict[str, Any]:
    return _router(request).models.get(model)


async def version(request: Request) -> dict[str, Any]:
    return {"version": pdserve_version()}


async def tokenize(request: Request) -> dict[str, Any]:
    return await _parsed(request, tokenize_api.tokenize(_router(request).parser, await request.body()))


async def detokenize(request: Request) -> dict[str, Any]:
    return await _parsed(request, tokenize_api.detokenize(_router(request).parser, await request.body()))


async def completions(request: Request) -> Any:
    received = time.monotonic()
    parsed = await _parsed(request, _router(request).parser.completion(await request.body()))
    return await _respond(request, parsed, received)


async def chat_completions(request: Request) -> Any:
    received = time.monotonic()
    parsed = await _parsed(request, _router(request).parser.chat(await request.body()))
    return await _respond(request, parsed, received)


async def _parsed(request: Request, parsing: Awaitable[T]) -> T:
    """What `parsing` returns; if it refuses the request, what the refusal leaves: the
    prompt's length in the access log, and the key's rate token back when the
    tokenizer's queue was full (the server's load, not the key's doing)."""
    try:
        return await parsing
    except APIError as exc:
        if isinstance(exc, TokenizerBusy):
            request.app.state.limits.refund(client_of(request.scope))
        refused(request.scope, exc.prompt_tokens)
        raise


async def _respond(request: Request, parsed: GenerateRequest, received: float) -> Response:
    router = _router(request)
    prompts = parsed.prompts
    client = client_of(request.scope)
    try:
        targets = slo.resolve(parsed.targets, slo.header_targets(request.headers), client, router.config.slo)
    except APIError:
        refused(request.scope, sum(map(len, prompts)))
        raise
    run = router.run_batch(prompts, parsed.params, parsed.priority, targets, client, received, parsed.lora)
    stream = _named_errors(_within_limits(request, parsed, run), parsed.constraint_source, parsed.chat)
    asked = parsed.params.logprobs is not None and not parsed.rank_only_logprobs
    formatter = functools.partial(LogprobFormatter, router.tokenizer, parsed.chat) if asked else None
    model_name = parsed.lora.name if parsed.lora is not None else router.model_name  # vLLM's answer names the adapter
    shaper = ResponseShaper(parsed.chat, model_name, list(map(len, prompts)), formatter,
                            _tool_calls(parsed, router.config.tool_call_parser), parsed.n, parsed.params.n)
    if isinstance(parsed, CompletionRequest) and parsed.scoring is not None:
        stream = echoed(stream, parsed.scoring, _prompt_texts(parsed, router.tokenizer), prompts, parsed.params.n,
                        router.tokenizer)
    stream = track(request.scope, shaper.id, sum(map(len, prompts)), stream)  # for its access log line
    if not parsed.stream:
        chunks = await _all_unless_disconnected(request, stream)
        if chunks is None:  # nobody is left to read an answer (499: nginx's "client closed")
            return Response(status_code=499)
        return JSONResponse(shaper.body(chunks), headers={WORKER_HEADER: chunks[-1].worker})
    # Its admission: errors until it is submitted (400, 429, 503) are the status; the
    # headers go now, not at its first token (a long prompt's prefill would hold them).
    admitted = await anext(stream)
    return StreamingResponse(_events(router, shaper, stream, parsed.include_usage),
                             media_type="text/event-stream", headers={WORKER_HEADER: admitted.worker})


def _prompt_texts(parsed: CompletionRequest, tokenizer: Any) -> list[str]:
    """Each prompt's text as sent (echo), or its token ids' text."""
    sent = parsed.prompt
    if isinstance(sent, str):
        return [sent]
    if isinstance(sent[0], str):
        return list(sent)
    return [tokenizer.decode(ids) for ids in parsed.prompts]


async def _events(router: Router, shaper: ResponseShaper, stream: AsyncGenerator[Chunk, None],
                  include_usage: bool) -> AsyncIterator[str]:
    """A streamed response's events after its admission: its chunks, the usage if
    asked, [DONE]."""
    started = False
    try:
        async for chunk in stream:
            started = True
            yield shaper.event(chunk)
        if include_usage:
            yield shaper.usage_event()
    except Exception as exc:  # noqa: BLE001 - the status line is sent: say it in the stream
        yield _error_event(router, exc, started)
    finally:
        await stream.aclose()  # a client gone mid-stream aborts the request
    yield DONE_EVENT


def _tool_calls(parsed: GenerateRequest, parser: str) -> Callable[[], ToolCallStream] | None:
    """How each choice's text of a chat request becomes tool calls: none without tools
    or with tool_choice "none"; else by the grammar's shape (required, a named function)
    or the model's own format (auto, read by router.tool_call_parser)."""
    tools = parsed.tools if isinstance(parsed, ChatRequest) else None
    if tools is None or tools.mode == "none":
        return None
    return functools.partial(ToolCallStream, tools.mode, tools.parameters, parallel_tool_calls=tools.parallel,
                             function_name=tools.named, parser=parser)


async def _named_errors(stream: AsyncGenerator[Chunk, None], source: str | None, chat: bool) -> AsyncGenerator[Chunk, None]:
    """The stream, with a decode worker's error said with the field the client sent:
    about the request's grammar, the one it came in (response_format, tools,
    structured_outputs); about its prompt, chat's `messages`."""
    try:
        async for chunk in stream:
            yield chunk
    except APIError as exc:
        exc = structured.worker_error(exc, source)
        if chat and exc.param == "prompt":
            exc.param = "messages"
        raise exc from None
    finally:
        await stream.aclose()


async def _within_limits(request: Request, parsed: GenerateRequest,
                         stream: AsyncGenerator[Chunk, None]) -> AsyncGenerator[Chunk, None]:
    """The stream, its tokens counted in its key's tokens in flight until it ends: each
    sequence's prompt + max_tokens (taken before it is submitted, so that a request the
    key has no room for is a 429 that never reaches a worker)."""
    limits: Limits = request.app.state.limits
    sequences = parsed.params.n
    lease = limits.lease(client_of(request.scope), sum(map(len, parsed.prompts)) * sequences,
                         parsed.params.max_tokens, sequences * len(parsed.prompts))
    generated: dict[int, int] = {}
    try:
        async for chunk in stream:
            generated[chunk.index] = chunk.num_tokens
            lease.progress(sum(generated.values()))
            yield chunk
    finally:
        limits.release(lease)
        await stream.aclose()


async def _all_unless_disconnected(request: Request, stream: AsyncGenerator[Chunk, None]) -> list[Chunk] | None:
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


def _error_event(router: Router, exc: Exception, started: bool) -> str:
    """The SSE event that ends a stream broken after its headers (e.g. its decode
    worker died with no live one to fail over to, or it refused the request), as vLLM
    sends one."""
    if not isinstance(exc, APIError):
        logger.exception("a stream failed", exc_info=exc)
        exc = APIError(500, f"internal error: {type(exc).__name__}: {exc}", kind="internal_server_error")
    if not started:  # refused before its first token, as its status would have said (Router.run_batch)
        router.metrics.rejected.labels(status=str(exc.status)).inc()
    return error_event(exc)  # after: counted as finished with reason "error" (Router.run_batch)
