"""The OpenAI-compatible HTTP front end: /v1/completions, /v1/chat/completions (both
streamed as server-sent events, or not), /v1/models, /health, /metrics and /status
(docs/api.md). Each endpoint is one small function: a body is parsed once into a typed
request (router/parsing.py), run by the Router (router/core.py), and its response
shaped by router/responses.py.

Bad input is HTTP 400 with an OpenAI-style error naming the field; a full queue is
HTTP 429 with Retry-After; no live decode worker is 503. API keys, the per-key request
rate and the body's size and arrival time are checked before any endpoint runs
(router/http_guard.py); a key's tokens in flight once its request is parsed. Every
request's outcome goes to the access log (router/access_log.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from router.access_log import AccessLog, track
from router.auth import KeyRing
from router.core import Chunk, Router
from router.errors import APIError
from router.http_guard import HTTPGuard, client_of
from router.limits import Limits
from router.logprobs import LogprobFormatter, echoed
from router import structured
from router.parsing import ChatRequest, CompletionRequest, GenerateRequest
from router.responses import DONE_EVENT, ResponseShaper, error_event, error_response
from router.tool_calls import ToolCallStream

__all__ = ["Router", "WORKER_HEADER", "create_app"]

logger = logging.getLogger(__name__)

# Names the decode worker serving a response (for a stream: the one that began it;
# otherwise the one that finished it), for operators and the failover test.
WORKER_HEADER = "x-pdserve-decode-worker"


def create_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        router.start()
        yield
        router.stop()

    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.state.router = router
    app.state.limits = limits = Limits(router.config)
    app.add_middleware(HTTPGuard, keys=KeyRing(router.config.api_keys or ()), limits=limits,
                       settings=router.config, rejected=lambda status: router.metrics.rejected.labels(
                           status=str(status)).inc())
    if router.config.access_log:  # added last: outside the guard, whose answers it logs too
        app.add_middleware(AccessLog, keys=KeyRing(router.config.api_keys or ()))
    app.add_exception_handler(APIError, _api_error)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/status", status, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    return app


def _router(request: Request) -> Router:
    return request.app.state.router


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    _router(request).metrics.rejected.labels(status=str(exc.status)).inc()
    return error_response(exc)


async def health(request: Request) -> JSONResponse:
    """200 while some decode worker is live; else 503, so that a load balancer or
    a readiness probe sees that this deployment can serve nothing."""
    router = _router(request)
    if not any(w.alive for w in router.workers):
        return error_response(router.no_live_worker())
    return JSONResponse({"status": "ok"})


async def status(request: Request) -> dict[str, Any]:
    """Every worker of both pools: live or not, and its own figures (None if it did
    not answer); `pdserve status` prints this."""
    router = _router(request)
    pools = router.workers + router.prefill
    replies = await asyncio.gather(*(w.stats() if w.alive else _none() for w in pools))
    rows = [{"name": w.name, "address": w.address, "live": w.alive, "stats": s} for w, s in zip(pools, replies)]
    return {"model": router.model_name, "in_flight": router.in_flight, "prefill_pool": bool(router.prefill),
            "decode_workers": rows[:len(router.workers)], "prefill_workers": rows[len(router.workers):]}


async def metrics(request: Request) -> Response:
    """The router's own metrics, and every live worker's figures of both pools, asked
    now (a dead one would only time out), labelled by worker and role."""
    router = _router(request)
    live = [(w, "decode") for w in router.workers if w.alive] + [(w, "prefill") for w in router.prefill if w.alive]
    for (worker, role), stats in zip(live, await asyncio.gather(*(w.stats() for w, _ in live))):
        if stats is not None:
            router.metrics.set_worker(worker.name, role, stats)
    router.publish_live()
    return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": _router(request).model_name, "object": "model",
                                        "created": 0, "owned_by": "pdserve"}]}


async def completions(request: Request) -> Any:
    parsed = await _router(request).parser.completion(await request.body())
    return await _respond(request, parsed)


async def chat_completions(request: Request) -> Any:
    parsed = await _router(request).parser.chat(await request.body())
    return await _respond(request, parsed)


async def _respond(request: Request, parsed: GenerateRequest) -> Response:
    router = _router(request)
    stream = _named_errors(_within_limits(request, parsed, router.run(parsed.prompt_ids, parsed.params)),
                           parsed.constraint_source)
    formatter = LogprobFormatter(router.tokenizer, parsed.chat) if parsed.params.logprobs is not None else None
    shaper = ResponseShaper(parsed.chat, router.model_name, len(parsed.prompt_ids), formatter,
                            _tool_calls(parsed, router.config.tool_call_parser))
    if isinstance(parsed, CompletionRequest) and parsed.scoring is not None:
        text = parsed.prompt if isinstance(parsed.prompt, str) else router.tokenizer.decode(parsed.prompt)
        stream = echoed(stream, parsed.scoring, text, parsed.prompt_ids, router.tokenizer)
    stream = track(request.scope, shaper.id, len(parsed.prompt_ids), stream)  # for its access log line
    if not parsed.stream:
        chunks = await _all_unless_disconnected(request, stream)
        if chunks is None:  # nobody is left to read an answer (499: nginx's "client closed")
            return Response(status_code=499)
        return JSONResponse(shaper.body(chunks), headers={WORKER_HEADER: chunks[-1].worker})
    first = await anext(stream)  # errors (400, 429) surface before any byte is sent
    return StreamingResponse(_events(router, shaper, first, stream, parsed.include_usage),
                             media_type="text/event-stream", headers={WORKER_HEADER: first.worker})


async def _events(router: Router, shaper: ResponseShaper, first: Chunk, stream: AsyncIterator[Chunk],
                  include_usage: bool) -> AsyncIterator[str]:
    """A streamed response's events: its chunks, the usage if asked, [DONE]."""
    n = first.num_tokens

    async def chunks() -> AsyncIterator[Chunk]:
        yield first
        async for chunk in stream:
            yield chunk

    try:
        async for chunk in chunks():
            n = chunk.num_tokens
            yield shaper.event(chunk)
        if include_usage:
            yield shaper.usage_event(n)
    except Exception as exc:  # noqa: BLE001 - the status line is sent: say it in the stream
        yield _error_event(router, exc)
    finally:
        await stream.aclose()  # a client gone mid-stream aborts the request
    yield DONE_EVENT


def _tool_calls(parsed: GenerateRequest, parser: str) -> ToolCallStream | None:
    """How a chat request's text becomes tool calls: none without tools or with
    tool_choice "none"; else by the grammar's shape (required, a named function) or the
    model's own format (auto, read by router.tool_call_parser)."""
    tools = parsed.tools if isinstance(parsed, ChatRequest) else None
    if tools is None or tools.mode == "none":
        return None
    return ToolCallStream(tools.mode, tools.parameters, parallel_tool_calls=tools.parallel,
                          function_name=tools.named, parser=parser)


async def _named_errors(stream: AsyncIterator[Chunk], source: str | None) -> AsyncIterator[Chunk]:
    """The stream, with a decode worker's error about the request's grammar said with the
    field the client sent it in (response_format, tools, structured_outputs)."""
    try:
        async for chunk in stream:
            yield chunk
    except APIError as exc:
        raise structured.worker_error(exc, source) from None
    finally:
        await stream.aclose()


async def _within_limits(request: Request, parsed: GenerateRequest,
                         stream: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    """The stream, its tokens counted in its key's tokens in flight until it ends (taken
    at its first step, so that a stream never started holds none; 429 before any
    chunk when the key has no room)."""
    limits: Limits = request.app.state.limits
    lease = limits.lease(client_of(request.scope), len(parsed.prompt_ids), parsed.params.max_tokens)
    try:
        async for chunk in stream:
            lease.progress(chunk.num_tokens)
            yield chunk
    finally:
        limits.release(lease)
        await stream.aclose()


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
    return error_event(exc)  # counted as finished with reason "error" (Router.run), not as rejected
