"""The OpenAI-compatible HTTP front end: /v1/completions, /v1/chat/completions (both
streamed as server-sent events, or not), /v1/models, /health, /metrics and /status
(docs/api.md). The request path behind it is router/core.py (Router).

Bad input is HTTP 400 with an OpenAI-style error naming the field; a full queue is
HTTP 429 with Retry-After; no live decode worker is 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from engine.sampling_params import SamplingParams
from router import request_body
from router.core import Chunk, Router
from router.errors import APIError
from router.logprobs import LogprobFormatter, merge

__all__ = ["Router", "WORKER_HEADER", "create_app"]

logger = logging.getLogger(__name__)

# Names the decode worker serving a response (for a stream: the one that began it;
# otherwise the one that finished it), for operators and the failover test.
WORKER_HEADER = "x-pdserve-decode-worker"


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
        except RecursionError:
            raise APIError(400, "request body is not valid JSON: nested too deeply") from None
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of > 4300 digits
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
