"""The one error type of the HTTP API: a status, an OpenAI-style message, the field."""

from __future__ import annotations


class APIError(Exception):
    """`code`: the OpenAI error code (e.g. "invalid_api_key"); None: none (null).
    `retry_after`: seconds a 429's client should wait (its Retry-After header; None: 1).
    `headers`: more response headers (a 401's WWW-Authenticate).
    `prompt_tokens`: a request refused once its prompt was tokenized: its length, for
    the access log (None: not tokenized)."""

    prompt_tokens: int | None = None

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", *, code: str | None = None,
                 retry_after: float | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code, self.retry_after, self.headers = code, retry_after, headers


class TokenizerBusy(APIError):
    """A 429 because the tokenizer's queue is full: the server's load, not the key's
    doing, so the request it refuses gives back the rate token it took."""
