"""The router's HTTP/1.1 connections, with a deadline on each request's headers.

uvicorn bounds a request head's size but not the time it takes to arrive, and every
byte that arrives cancels its keep-alive timer: a client sending one header byte a
second (slowloris) would hold a connection, and a file descriptor, for as long as it
likes, before the router's own gate (router/http_guard.py, which bounds the body) ever
sees it. Here a connection waiting for a request's headers (a new one, or a kept-alive
one between requests) is closed once they have not all arrived within the deadline.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


def with_header_deadline(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose next request head has not
    arrived within timeout_s of the connection opening or the last response ending."""

    class HeaderDeadlineProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
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

    return HeaderDeadlineProtocol
