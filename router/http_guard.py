"""The router's gate, an ASGI middleware in front of every endpoint: API keys, the
per-key request rate, and the request body's type, size and arrival time.

In order, before an endpoint runs:
1. API key (router/auth.py), when router.api_keys is set: every path but /health,
   /admin/ (and /metrics, unless router.metrics_need_key is false) needs one; else
   401. An /admin/ path, and loading or unloading a LoRA adapter (router/adapters.py),
   needs an admin key (router.admin_keys; 401 without one of them, API keys
   included), and is off (403) when none is configured.
2. A Content-Type other than application/json on the JSON endpoints (generation,
   /tokenize, /detokenize): 400, as vLLM answers (no Content-Type passes).
3. Requests per second per key (router/limits.py), for the generation endpoints and
   /tokenize, /detokenize (which use the same tokenizer thread): 429.
4. A Content-Length over router.max_body_bytes: 413 without reading a byte of it.
Then, while the endpoint reads the body: 413 as soon as the bytes received pass
max_body_bytes (a chunked body says no length up front), and 408 once the body has
taken router.body_timeout_s to arrive (a client trickling bytes holds no connection
longer). Each of these answers closes the connection: the rest of the body is never
read by the app, nor is that of a request answered without reading it (e.g. /health);
the connection drops at most twice max_body_bytes more of it before closing
(cluster/http_protocol.py's lingering close), so that a client sending it whole reads
the answer rather than a reset. A client
that hangs up mid-body is counted as 499 (nginx's "client closed"), not taken for a
server error. The headers' own arrival time is bounded below this, by the HTTP
protocol (cluster/http_protocol.py).

The body is never read whole before it is bounded, and no key is ever logged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, MutableMapping
from typing import Any

from router.adapters import ADMIN_PATHS
from router.admin import ADMIN_PREFIX
from router.auth import REALM, KeyRing, unauthorized
from router.config import GuardSettings
from router.errors import APIError
from router.limits import Limits
from router.responses import error_response

OPEN_PATHS = frozenset({"/health"})
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
RATE_LIMITED_PATHS = GENERATE_PATHS | {"/tokenize", "/detokenize"}
# The key a request came with, in its ASGI scope: its index in router.api_keys (None
# without keys). Endpoints read it with client_of().
CLIENT = "pdserve.client"
CLOSE = {"Connection": "close"}

ASGIApp = Callable[..., Any]


def client_of(scope: MutableMapping[str, Any]) -> int | None:
    return scope.get(CLIENT)


class HTTPGuard:
    """Who calls what: Starlette builds it once (app.add_middleware) and calls it per
    request; `rejected(status)` counts each answer it gives itself in the metrics."""

    def __init__(self, app: ASGIApp, keys: KeyRing, limits: Limits, settings: GuardSettings,
                 rejected: Callable[[int], None], admin_keys: KeyRing | None = None) -> None:
        self.app, self.keys, self.limits, self.settings, self.rejected = app, keys, limits, settings, rejected
        self.admin_keys = admin_keys or KeyRing(())

    async def __call__(self, scope: MutableMapping[str, Any], receive: ASGIApp, send: ASGIApp) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # names are lower-case bytes (ASGI)
        try:
            self._admit(scope, headers)
        except APIError as exc:
            # The body is left unread: close, or a client trickling it would hold the
            # connection while the server drains it.
            exc.headers = {**(exc.headers or {}), **CLOSE}
            self.rejected(exc.status)
            await error_response(exc)(scope, receive, send)
            return
        body = _Body(headers)
        await self.app(scope, self._bounded(receive, body), _closing_unless_read(send, body))

    def _admit(self, scope: MutableMapping[str, Any], headers: dict[bytes, bytes]) -> None:
        path = scope["path"]
        client = None
        if path.startswith(ADMIN_PREFIX) or path in ADMIN_PATHS:
            self._admit_admin(scope, headers)
        elif len(self.keys) and path not in OPEN_PATHS and (path != "/metrics" or self.settings.metrics_need_key):
            if sum(name == b"authorization" for name, _ in scope["headers"]) > 1:
                # Which one counts would be a guess, and a proxy in front may guess otherwise.
                raise unauthorized("Send one Authorization header, not several", REALM)
            client = self.keys.identify(headers.get(b"authorization"))
        scope[CLIENT] = client
        if path in RATE_LIMITED_PATHS and scope["method"] == "POST":
            _check_json(headers)
            self.limits.admit(client)
        length = headers.get(b"content-length")
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                raise APIError(400, "the Content-Length header is not a number") from None
            if size > self.settings.max_body_bytes:
                raise _too_large(f"the request body is {size} bytes", self.settings.max_body_bytes)

    def _admit_admin(self, scope: MutableMapping[str, Any], headers: dict[bytes, bytes]) -> None:
        if not len(self.admin_keys):
            raise APIError(403, "the admin endpoints are off: set router.admin_keys to scale this deployment or "
                                "load LoRA adapters over HTTP", kind="permission_error")
        if sum(name == b"authorization" for name, _ in scope["headers"]) > 1:
            raise unauthorized("Send one Authorization header, not several", REALM)
        try:
            self.admin_keys.identify(headers.get(b"authorization"))
        except APIError as exc:
            if exc.status == 401 and "Incorrect API key" in exc.message:  # an API key is not an admin key
                raise unauthorized("Incorrect admin key provided: the admin endpoints (/admin/, loading LoRA "
                                   "adapters) need a key of router.admin_keys",
                                   f'{REALM}, error="invalid_token"') from None
            raise

    def _bounded(self, receive: ASGIApp, body: _Body) -> ASGIApp:
        """`receive` that raises APIError 413 once the body passes max_body_bytes and
        408 once it has taken body_timeout_s; after the body, `receive` itself (a
        handler then waits on it for the client's disconnect, without a deadline)."""
        limit, timeout = self.settings.max_body_bytes, self.settings.body_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        received = 0

        async def bounded() -> dict[str, Any]:
            nonlocal received
            if body.done:
                return await receive()
            try:
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    message = await receive()
            except TimeoutError:
                raise APIError(408, f"the request body did not arrive within {timeout:g} s "
                                    "(router.body_timeout_s)", headers=CLOSE) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _too_large(f"the request body passed {limit} bytes", limit)
                body.done = not message.get("more_body", False)
            else:  # http.disconnect: nothing more will come, and nobody reads an answer
                raise APIError(499, "the client went away before its request body arrived")
            return message

        return bounded


def _check_json(headers: dict[bytes, bytes]) -> None:
    """A JSON endpoint's body says it is JSON, as vLLM requires (a 400, as vLLM's): a
    form or text would be parsed as JSON by accident. No Content-Type at all passes
    (vLLM refuses that too; scripts sending raw bytes often leave it out)."""
    sent = headers.get(b"content-type")
    if sent is not None and sent.split(b";")[0].strip().lower() != b"application/json":
        raise APIError(400, f"Unsupported Media Type {sent.decode('latin-1')!r}: only 'application/json' is "
                            "allowed (send Content-Type: application/json)")


def _too_large(what: str, limit: int) -> APIError:
    return APIError(413, f"{what}; at most {limit} bytes are accepted (router.max_body_bytes)", headers=CLOSE)


class _Body:
    """Whether a request's body has been read whole (a request without one has)."""

    def __init__(self, headers: dict[bytes, bytes]) -> None:
        self.done = headers.get(b"content-length", b"0") == b"0" and b"transfer-encoding" not in headers


def _closing_unless_read(send: ASGIApp, body: _Body) -> ASGIApp:
    """`send` that closes the connection after a response given before the request's
    body was read whole (an endpoint that reads none, e.g. /health): else the server
    would go on reading and dropping whatever the client still sends, for as long as
    it sends, with no size or time bound."""
    async def closing(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and not body.done:
            headers = list(message.get("headers", []))
            if not any(name.lower() == b"connection" for name, _ in headers):  # an error here says it already
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return closing
