"""Per-key limits at the router: requests per second and tokens in flight.

A client is an API key, named by its position in router.api_keys; without keys every
caller is the one client None. Requests per second are a token bucket: it holds at
most `burst` requests (so a key idle for a while may send that many at once) and
refills at `requests_per_s`. Tokens in flight are the prompt tokens + max_tokens of
the key's running requests: what they may still occupy in the KV caches. Over either:
HTTP 429 with a Retry-After computed from the bucket's refill or from the pace of the
key's running requests.

Pure Python on the router's one event loop: no locking. State is kept per configured
key (or the one client), so it never grows with the callers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from router.errors import APIError

MAX_RETRY_AFTER_S = 60  # OpenAI's clients wait at most this long on a Retry-After


class LimitSettings(Protocol):
    """The fields of cluster.router_config.RouterConfig read here (documented and validated there)."""

    @property
    def key_requests_per_s(self) -> float | None: ...

    @property
    def key_burst(self) -> int | None: ...

    @property
    def key_tokens_in_flight(self) -> int | None: ...


@dataclass
class TokenBucket:
    rate: float  # requests per second
    burst: float  # most requests it holds
    tokens: float
    stamp: float  # when `tokens` was last brought up to date

    def take(self, now: float) -> float:
        """0 if a request may go now (and it is counted); else the seconds until one may."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


@dataclass(eq=False)
class Lease:
    """One running request's share of its key's tokens in flight, held until it ends."""

    client: int | None
    cost: int  # prompt tokens + max_tokens
    max_tokens: int
    start: float
    generated: int = 0

    def progress(self, generated: int) -> None:
        self.generated = generated

    def eta(self, now: float) -> float:
        """Seconds until it ends at its pace so far (generating all of max_tokens: a stop
        may end it sooner); inf before its first token."""
        if self.generated <= 0:
            return math.inf
        return (self.max_tokens - self.generated) * (now - self.start) / self.generated


@dataclass
class _Client:
    bucket: TokenBucket | None
    in_flight: int = 0
    leases: set[Lease] = field(default_factory=set)


class Limits:
    """Who calls what: the HTTP guard calls admit() once per generation request, before
    its body is read; the endpoint takes a lease() once the request is parsed and
    releases it when the request ends, however it ends, and refund()s the rate token of
    a request the tokenizer's full queue refused."""

    def __init__(self, settings: LimitSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = settings.key_requests_per_s
        self.burst = settings.key_burst or max(1, math.ceil(self.rate or 1))
        self.max_tokens = settings.key_tokens_in_flight
        self.clock = clock
        self._clients: dict[int | None, _Client] = {}

    def _client(self, client: int | None) -> _Client:
        if client not in self._clients:
            bucket = TokenBucket(self.rate, self.burst, self.burst, self.clock()) if self.rate else None
            self._clients[client] = _Client(bucket)
        return self._clients[client]

    def admit(self, client: int | None) -> None:
        """Count one request against the key's rate; APIError(429) if over it."""
        state = self._client(client)
        if state.bucket is None:
            return
        wait = state.bucket.take(self.clock())
        if wait > 0:
            raise _too_many(f"this API key is over its rate of {self.rate:g} requests per second "
                            f"(burst {self.burst}); retry in {wait:.2f} s", wait)

    def refund(self, client: int | None) -> None:
        """Give back the rate token admit() took for a request the server refused for its
        own load (router/errors.py TokenizerBusy), not for the key's."""
        state = self._client(client)
        if state.bucket is not None:
            state.bucket.tokens = min(state.bucket.burst, state.bucket.tokens + 1)

    def lease(self, client: int | None, prompt_tokens: int, max_tokens: int, sequences: int = 1) -> Lease:
        """Count a parsed request's tokens against the key's tokens in flight; APIError
        429 if the key's running requests leave no room for it now, 400 if it alone is
        over the limit (no wait would let it in). A request sampling several sequences
        (n, best_of, batched prompts) costs each its prompt + max_tokens: prompt_tokens
        is then the sum over its sequences, and max_tokens is each one's."""
        state = self._client(client)
        now = self.clock()
        lease = Lease(client, prompt_tokens + sequences * max_tokens, sequences * max_tokens, now)
        limit = self.max_tokens
        if limit is not None and lease.cost > limit:
            what = f"max_tokens ({max_tokens})" if sequences == 1 else f"{sequences} sequences x max_tokens ({max_tokens})"
            raise APIError(400, f"prompt ({prompt_tokens} tokens) + {what} = {lease.cost} is more "
                                f"than an API key may have in flight ({limit} tokens); lower max_tokens", "max_tokens")
        if limit is not None and state.in_flight + lease.cost > limit:
            need = state.in_flight + lease.cost - limit
            raise _too_many(f"this API key has {state.in_flight} tokens in flight (prompt + max_tokens of its "
                            f"running requests); this request's {lease.cost} would pass its limit of {limit}",
                            self._until_freed(state, need, now))
        state.in_flight += lease.cost
        state.leases.add(lease)
        return lease

    def release(self, lease: Lease) -> None:
        """The request ended; idempotent."""
        state = self._clients[lease.client]
        if lease in state.leases:
            state.leases.discard(lease)
            state.in_flight -= lease.cost

    def in_flight(self, client: int | None) -> int:
        return self._clients[client].in_flight if client in self._clients else 0

    @staticmethod
    def _until_freed(state: _Client, need: int, now: float) -> float:
        """Seconds until requests ending soonest (at their pace so far) free `need`
        tokens; 1 while none has a pace yet."""
        freed = 0
        for lease in sorted(state.leases, key=lambda x: x.eta(now)):
            freed += lease.cost
            if freed >= need:
                eta = lease.eta(now)
                return eta if math.isfinite(eta) else 1.0
        return 1.0


def _too_many(message: str, wait: float) -> APIError:
    return APIError(429, message, kind="rate_limit_error", retry_after=retry_after(wait))


def retry_after(wait: float) -> int:
    """Whole seconds for a Retry-After header: at least 1, at most MAX_RETRY_AFTER_S."""
    return min(MAX_RETRY_AFTER_S, max(1, math.ceil(wait)))
