"""The router's HTTP/1.1 connections: a deadline on each request's headers, and a
lingering close after an answer given before the request's body was all in.

uvicorn bounds a request head's size but not the time it takes to arrive, and every
byte that arrives cancels its keep-alive timer: a client sending one header byte a
second (slowloris) would hold a connection, and a file descriptor, for as long as it
likes, before the router's own gate (router/http_guard.py, which bounds the body) ever
sees it. Here a connection waiting for a request's headers (a new one, or a kept-alive
one between requests) is closed once they have not all arrived within the deadline.

A connection closed with bytes unread makes the kernel send a reset, and a client still
sending its body (Python's urllib and requests send it whole before reading a byte)
then sees "connection reset", never the 413 or 401 the router answered. So, as nginx's
lingering close does, such a connection first ends its writing side (the answer is
complete, and the client reads it at its pace), then reads and drops what the client
still sends, at most `linger_bytes` and LINGER_S seconds, and closes when the client
does or a bound is reached.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

LINGER_S = 5.0  # nginx's lingering_timeout: the most a client still sending is waited for


def with_header_deadline(timeout_s: float, linger_bytes: int = 0) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose next request head has not
    arrived within timeout_s of the connection opening or the last response ending,
    and lingering (above) for at most linger_bytes (0: never) when it closes one whose
    request body was not all read."""

    class HeaderDeadlineProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _lingering: _Linger | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            # Every close, the request cycles' included, goes through this one.
            self.transport = _LingeringClose(transport, self._linger)  # type: ignore[assignment]  # a wrapper with the transport's verbs
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._lingering is not None:
                self._lingering.drop(len(data))
                return
            super().data_received(data)

        def eof_received(self) -> None:
            if self._lingering is not None:  # the client sent all it will: done
                self._lingering.transport.close()
                return
            super().eof_received()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            if self._lingering is not None:
                self._lingering.timer.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(timeout_s, self._expire)

        def _expire(self) -> None:
            # A request whose head is in has a cycle still running: its body and answer
            # are bounded elsewhere. None, or a finished one: we are waiting for a head.
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and not self.transport.is_closing():
                self.transport.close()

        def _linger(self, transport: asyncio.Transport) -> bool:
            """Called on the first close(): whether to linger (the client is still
            sending a request body) rather than close now."""
            if linger_bytes <= 0 or self.conn.their_state is not h11.SEND_BODY:
                return False
            self._lingering = _Linger(transport, linger_bytes, self.loop.call_later(LINGER_S, transport.close))
            if transport.can_write_eof():
                transport.write_eof()  # after the answer still buffered, if any
            transport.resume_reading()  # uvicorn pauses it while a body waits to be read
            return True

    return HeaderDeadlineProtocol


class _Linger:
    """A connection lingering: what it may still read before it closes."""

    def __init__(self, transport: asyncio.Transport, left: int, timer: asyncio.TimerHandle) -> None:
        self.transport, self.left, self.timer = transport, left, timer

    def drop(self, size: int) -> None:
        self.left -= size
        if self.left < 0:
            self.transport.close()


class _LingeringClose:
    """A connection's transport whose first close() may linger (`linger(transport)`
    says whether it does); a second one, e.g. the server shutting down, closes."""

    def __init__(self, transport: asyncio.Transport, linger: Callable[[asyncio.Transport], bool]) -> None:
        self._transport, self._linger, self._closing = transport, linger, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._closing or self._transport.is_closing()

    def close(self) -> None:
        first, self._closing = not self._closing, True
        if first and not self._transport.is_closing() and self._linger(self._transport):
            return
        self._transport.close()
