"""Logprobs in the two OpenAI response shapes, and completions' `echo` and prompt logprobs.

The decode worker sends, per generated token, [logprob, [[token_id, logprob], ...]]
(its top alternatives, best first). Completions want parallel lists (tokens,
token_logprobs, top_logprobs, text_offset); chat wants one object per token with its
bytes (the UTF-8 of its text). Token text is each token decoded alone, as OpenAI reports
it, except a token that decodes alone to a partial UTF-8 character (byte-level BPE
splits one character over several tokens), as vLLM (since its PR #28874) does: its text
is what it completes after the sequence's last few tokens, "" while the character is
still incomplete and the whole character on the token that completes it. So a
sequence's token texts (and bytes) join to its text, never to U+FFFD (bytes that never
make a character, the text's U+FFFD, are said as "").

Prompt logprobs (the engine's params.prompt_logprobs) come with a request's first
tokens, [logprob, rank, top] per prompt token from the second. `echo` puts the prompt
before the text and, with `logprobs`, its tokens' entries first (the first token's
logprob and top_logprobs null); vLLM's `prompt_logprobs` field returns them in the
choice in vLLM's shape. `max_tokens: 0` with echo (OpenAI's legacy scoring call)
asks the engine for one token and returns none of it: the prompt alone, finish_reason
"length".
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.user_values import show
from router.errors import APIError

if TYPE_CHECKING:  # router/core.py imports this module (by way of router/parsing.py)
    from router.core import Chunk

MAX_TOP = 20  # the engine's limit (SamplingParams.logprobs)
# Tokens before a partial character that may complete it: a UTF-8 character has at most 4 bytes.
MAX_CONTEXT = 4
REPLACEMENT = "\ufffd"


def requested_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives per token the request asks for; None: no logprobs.

    Completions: `logprobs` is that number. Chat: `logprobs` is a switch (a boolean,
    or 0 / 1 for false / true) and `top_logprobs` the number (0 when absent)."""
    if not chat:
        k = body.get("logprobs")
        if k is None:
            return None
        _check_count(k, "logprobs")
        return k
    top = body.get("top_logprobs")
    switch = body.get("logprobs")
    if type(switch) is int and switch in (0, 1):  # as vLLM's pydantic bool reads them
        switch = bool(switch)
    if switch is None or switch is False:  # not `in`: 0.0 == False
        if top is not None:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return None
    if switch is not True:
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
        self.context: list[int] = []  # the sequence's last MAX_CONTEXT tokens formatted

    def _text(self, token_id: int) -> str:
        """The token's text after self.context: alone, unless that is a partial
        character (see the module's docstring)."""
        text = self.tokenizer.decode([token_id])
        if not text.endswith(REPLACEMENT):
            return text
        for n in range(1, len(self.context) + 1):
            context = self.context[-n:]
            whole = self.tokenizer.decode(context + [token_id])
            if whole.endswith(REPLACEMENT):
                continue
            # Context tokens that were partial characters themselves said "": their
            # bytes are this token's to say.
            clean = n
            while clean and self.tokenizer.decode(context[clean - 1:clean]).endswith(REPLACEMENT):
                clean -= 1
            prefix = self.tokenizer.decode(context[:clean]) if clean else ""
            return whole[len(os.path.commonprefix([prefix, whole])):]
        return ""

    def _advance(self, token_id: int) -> None:
        self.context = [*self.context[1 - MAX_CONTEXT:], token_id]

    def format(self, token_ids: list[int], entries: list[list[Any]]) -> dict[str, Any]:
        if self.chat:
            return {"content": [self._chat_entry(t, lp, top) for t, (lp, top) in zip(token_ids, entries)]}
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, (lp, top) in zip(token_ids, entries):
            text = self._text(t)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            # None: an echoed prompt's first token, which nothing predicts. The chosen token
            # first, then the alternatives: up to logprobs + 1 entries (OpenAI's legacy
            # API "always returns the logprob of the sampled token", and vLLM does so).
            if top is None:
                out["top_logprobs"].append(None)
            else:
                entry = {text: lp}
                for a, v in top:
                    entry.setdefault(self._text(a), v)
                out["top_logprobs"].append(entry)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            self._advance(t)
        return out

    def _chat_entry(self, token_id: int, logprob: float, top: list[list[Any]]) -> dict[str, Any]:
        def item(t: int, v: float) -> dict[str, Any]:
            text = self._text(t)
            return {"token": text, "logprob": v, "bytes": list(text.encode())}

        entry = {**item(token_id, logprob), "top_logprobs": [item(a, v) for a, v in top]}
        self._advance(token_id)
        return entry


def merge(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One non-streamed response's logprobs from its chunks' (same keys, lists joined)."""
    if not parts:
        return None
    return {key: [x for p in parts for x in p[key]] for key in parts[0]}


@dataclass(frozen=True)
class PromptScoring:
    """What a completions request asks of its prompt (prompt_scoring())."""

    echo: bool  # the prompt before the text (and before the logprobs, with `logprobs`)
    prompt_only: bool  # max_tokens 0 with echo: the prompt alone
    echo_logprobs: int | None  # alternatives per echoed prompt token (`logprobs` under echo)
    vllm_prompt_logprobs: int | None  # vLLM's `prompt_logprobs` field: alternatives per token

    @property
    def engine_count(self) -> int | None:
        """params.prompt_logprobs: enough alternatives for both uses; None: none needed."""
        counts = [c for c in (self.echo_logprobs, self.vllm_prompt_logprobs) if c is not None]
        return max(counts) if counts else None


def prompt_scoring(body: dict[str, Any]) -> tuple[dict[str, Any], PromptScoring | None]:
    """A completions body's echo, max_tokens 0 and prompt_logprobs: the body to read
    the sampling fields from (max_tokens 0 made 1), and what to do with the prompt
    (None: nothing)."""
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise APIError(400, f"echo must be a boolean, got {show(echo)}", "echo")
    vllm = body.get("prompt_logprobs")
    if vllm is not None:
        _check_count(vllm, "prompt_logprobs")
    zero = [name for name in ("max_tokens", "max_completion_tokens") if type(body.get(name)) is int and body[name] == 0]
    if zero and not echo:
        raise APIError(400, f"{zero[0]}=0 needs echo: true (it returns the prompt alone); otherwise "
                            f"{zero[0]} must be >= 1", zero[0])
    if not echo and vllm is None:
        return body, None
    if zero:
        body = {**body, **{name: 1 for name in zero}}
    k = body.get("logprobs")
    echo_k = k if echo and k is not None else None  # requested_logprobs() checks k itself
    if echo_k is not None:
        _check_count(echo_k, "logprobs")
    return body, PromptScoring(bool(echo), bool(zero), echo_k, vllm)


async def echoed(stream: AsyncGenerator[Chunk, None], scoring: PromptScoring | None, prompt_texts: list[str],
                 prompts: list[list[int]], sampled: int, tokenizer: Any) -> AsyncGenerator[Chunk, None]:
    """The stream with each sequence's first chunk carrying its prompt as `scoring`
    asks (the stream itself when it asks nothing). Sequence i's prompt is
    i // `sampled` (batched prompts); the admission chunk passes as it is."""
    if scoring is None:
        async for chunk in stream:
            yield chunk
        return
    seen: set[int] = set()
    try:
        async for chunk in stream:
            if chunk.admission:
                yield chunk
            elif chunk.index not in seen:
                seen.add(chunk.index)
                p = chunk.index // sampled
                yield _with_prompt(chunk, scoring, prompt_texts[p], prompts[p], tokenizer)
            elif not scoring.prompt_only:
                yield chunk
    finally:
        await stream.aclose()


def _with_prompt(chunk: Chunk, scoring: PromptScoring, prompt_text: str, prompt_ids: list[int],
                 tokenizer: Any) -> Chunk:
    prompt = chunk.prompt_logprobs or []
    if scoring.prompt_only:
        chunk = dataclasses.replace(chunk, text="", finish_reason="length", num_tokens=0, token_ids=[], logprobs=[])
    changes: dict[str, Any] = {}
    if scoring.echo:
        changes["text"] = prompt_text + chunk.text
        if scoring.echo_logprobs is not None:
            k = scoring.echo_logprobs
            entries = [[None, None]] + [[lp, top[:k]] for lp, _, top in prompt]
            changes["token_ids"] = list(prompt_ids) + chunk.token_ids
            changes["logprobs"] = entries + chunk.logprobs
    if scoring.vllm_prompt_logprobs is not None:
        changes["vllm_prompt_logprobs"] = vllm_prompt_logprobs(prompt_ids, prompt, scoring.vllm_prompt_logprobs,
                                                               tokenizer)
    return dataclasses.replace(chunk, **changes)


def vllm_prompt_logprobs(prompt_ids: list[int], entries: list[list[Any]], k: int,
                         tokenizer: Any) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's shape: None for the first token, then per token {token id: {logprob,
    rank, decoded_token}} with the prompt token and its top-k alternatives."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for token, (lp, rank, top) in zip(prompt_ids[1:], entries):
        item = {str(token): {"logprob": lp, "rank": rank, "decoded_token": tokenizer.decode([token])}}
        for i, (alt, v) in enumerate(top[:k]):
            item.setdefault(str(alt), {"logprob": v, "rank": i + 1, "decoded_token": tokenizer.decode([alt])})
        out.append(item)
    return out
