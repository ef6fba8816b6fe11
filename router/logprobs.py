"""Logprobs in the two OpenAI response shapes.

The decode worker sends, per generated token, [logprob, [[token_id, logprob], ...]]
(its top alternatives, best first). Completions want parallel lists (tokens,
token_logprobs, top_logprobs, text_offset); chat wants one object per token with its
bytes. Token text is each token decoded alone, as OpenAI reports it.
"""

from __future__ import annotations

from typing import Any

from router.errors import APIError

MAX_TOP = 20  # the engine's limit (SamplingParams.logprobs)


def requested_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives per token the request asks for; None: no logprobs.

    Completions: `logprobs` is that number. Chat: `logprobs` is a switch and
    `top_logprobs` the number (0 when absent)."""
    if not chat:
        k = body.get("logprobs")
        if k is None:
            return None
        _check_count(k, "logprobs")
        return k
    top = body.get("top_logprobs")
    if body.get("logprobs") in (None, False):
        if top is not None:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return None
    if body["logprobs"] is not True:
        raise APIError(400, f"logprobs must be a boolean, got {body['logprobs']!r}", "logprobs")
    if top is None:
        return 0
    _check_count(top, "top_logprobs")
    return top


def _check_count(k: Any, param: str) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP:
        raise APIError(400, f"{param} must be an integer in [0, {MAX_TOP}], got {k!r}", param)


class LogprobFormatter:
    """Formats one request's logprobs chunk by chunk (text offsets carry over)."""

    def __init__(self, tokenizer: Any, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.offset = 0  # completions' text_offset of the next token

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def format(self, token_ids: list[int], entries: list[list[Any]]) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._chat_entry(t, lp, top) for t, (lp, top) in zip(token_ids, entries)]}
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, (lp, top) in zip(token_ids, entries):
            text = self._text(t)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({self._text(a): v for a, v in top})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def _chat_entry(self, token_id: int, logprob: float, top: list[list[Any]]) -> dict[str, Any]:
        def item(t: int, v: float) -> dict[str, Any]:
            text = self._text(t)
            return {"token": text, "logprob": v, "bytes": list(text.encode())}

        return {**item(token_id, logprob), "top_logprobs": [item(a, v) for a, v in top]}


def merge(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One non-streamed response's logprobs from its chunks' (same keys, lists joined)."""
    if not parts:
        return None
    return {key: [x for p in parts for x in p[key]] for key in parts[0]}
