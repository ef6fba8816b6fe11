"""The router's access log: one line per HTTP request it answers, on the `pdserve.access`
logger, written when the response has ended (for a stream: its last event sent, or its
client gone). router.access_log: false leaves it out. docs/api.md has the format.

`AccessLog`, an ASGI middleware outside every other (router/http_guard.py's answers
are logged too), keeps the request's `AccessRecord` in its scope; a generation
endpoint fills in the rest with `track()`. A line names an API key only by a short
prefix of its SHA-256 (router/auth.py), never the key.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections.abc import AsyncGenerator, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import ClientDisconnect

from router.auth import KeyRing
from router.core import Chunk
from router.errors import APIError
from router.http_guard import GENERATE_PATHS, client_of

LOGGER = "pdserve.access"
logger = logging.getLogger(LOGGER)
RECORD = "pdserve.access"  # the request's AccessRecord, in its ASGI scope
# HTTP status of a response its client did not wait for (nginx's "client closed").
CLIENT_GONE = 499

ASGIApp = Callable[..., Any]


@dataclass
class AccessRecord:
    """What one request's line says. Monotonic seconds; None: not known (yet)."""

    method: str
    path: str
    client: str  # host:port it came from
    start: float
    status: int | None = None  # of the response's start
    complete: bool = False  # its last body byte went out
    generation: bool = False  # to a completions endpoint: the token fields apply
    request_id: str = "-"  # the response's "id" (none for a request refused before it was parsed)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    first_token: float | None = None
    finish_reason: str | None = None
    error: int | None = None  # a stream broken after its first event: the error's status
    remote_prefill: bool | None = None
    worker: str = "-"
    key: str | None = None  # the API key's fingerprint
    sequences: dict[int, int] = field(default_factory=dict)  # output tokens of each of its sequences

    def saw(self, chunk: Chunk) -> None:
        if chunk.num_tokens and self.first_token is None:
            self.first_token = time.monotonic()
        self.sequences[chunk.index] = chunk.num_tokens
        self.output_tokens = sum(self.sequences.values())
        self.worker = chunk.worker or self.worker
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        if chunk.remote_prefill is not None:
            self.remote_prefill = chunk.remote_prefill

    def line(self, now: float) -> str:
        """`client "METHOD path" status`, then key=value fields (absent ones: -)."""
        status = self.status if self.status is not None else 500
        gone = status == 200 and not self.complete  # the headers went, the client left mid-body
        fields = [f'{self.client} "{self.method} {self.path}" {CLIENT_GONE if gone else status}']
        if self.generation:
            if self.error is not None:
                finish = f"error({self.error})"
            else:
                finish = "abort" if gone or status == CLIENT_GONE else (self.finish_reason or "-")
            prefill = "-" if self.remote_prefill is None else ("remote" if self.remote_prefill else "local")
            prompt = "-" if self.prompt_tokens is None else self.prompt_tokens
            fields += [f"id={self.request_id}", f"prompt_tokens={prompt}",
                       f"output_tokens={self.output_tokens}", f"ttft={_seconds(self.first_token, self.start)}",
                       f"total={_seconds(now, self.start)}", f"finish={finish}", f"prefill={prefill}",
                       f"worker={self.worker}"]
        else:
            fields.append(f"total={_seconds(now, self.start)}")
        if self.key is not None:
            fields.append(f"key={self.key}")
        return " ".join(fields)


def _seconds(end: float | None, start: float) -> str:
    return "-" if end is None else f"{end - start:.3f}s"


class AccessLog:
    """Who calls what: Starlette builds it once (app.add_middleware, after the guard, so
    that it wraps it) and calls it per request; it logs the request's line once the
    app is done with it, whatever the outcome."""

    def __init__(self, app: ASGIApp, keys: KeyRing) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: MutableMapping[str, Any], receive: ASGIApp, send: ASGIApp) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host, port = scope.get("client") or ("-", 0)
        method, path = scope["method"], scope["path"]
        # Percent-encoded again, as uvicorn's log does: the decoded path may hold a newline
        # or a quote, and a client must not be able to write a line of its own.
        record = scope[RECORD] = AccessRecord(method, urllib.parse.quote(path), f"{host}:{port}", time.monotonic(),
                                              generation=method == "POST" and path in GENERATE_PATHS)

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                record.complete = True  # sent: a client that left before this is gone

        try:
            await self.app(scope, receive, sending)
        except (asyncio.CancelledError, OSError, ClientDisconnect):  # the client (or the server) closed it
            record.status = CLIENT_GONE if record.status in (None, 200) else record.status
            raise
        finally:
            if logger.isEnabledFor(logging.INFO):
                client = client_of(scope)
                record.key = None if client is None else self.keys.fingerprint(client)
                logger.info("%s", record.line(time.monotonic()))


def refused(scope: MutableMapping[str, Any], prompt_tokens: int | None) -> None:
    """A generation request refused while it was parsed: its prompt's length, if it was
    tokenized (e.g. a prompt too long for the context)."""
    record: AccessRecord | None = scope.get(RECORD)
    if record is not None and prompt_tokens is not None:
        record.prompt_tokens = prompt_tokens


def track(scope: MutableMapping[str, Any], request_id: str, prompt_tokens: int,
          stream: AsyncGenerator[Chunk, None]) -> AsyncGenerator[Chunk, None]:
    """The request's chunks, its record filled in as they pass (no record, as with
    router.access_log false: the stream itself)."""
    record: AccessRecord | None = scope.get(RECORD)
    if record is None:
        return stream
    record.request_id, record.prompt_tokens = request_id, prompt_tokens
    return _observed(record, stream)


async def _observed(record: AccessRecord, stream: AsyncGenerator[Chunk, None]) -> AsyncGenerator[Chunk, None]:
    try:
        async for chunk in stream:
            record.saw(chunk)
            yield chunk
    except APIError as exc:
        record.error = exc.status
        raise
    except Exception:
        record.error = 500
        raise
    finally:
        await stream.aclose()
