"""OpenAI response bodies and server-sent events, from a request's chunks (Router.run).

Completions answer `text_completion` objects with `choices[i].text`; chat answers
`chat.completion` objects with `choices[i].message` (streamed: `chat.completion.chunk`
with `choices[i].delta`, the role in each choice's first delta only). Each choice has
its own index, finish_reason and logprobs. A stream is one `data: {json}` event per
chunk, of one choice (choices interleave as their sequences produce them), then, with
stream_options.include_usage, one with empty choices and the usage, then
`data: [DONE]`; a stream broken after its first event ends with an error event before
[DONE] (as vLLM does). Errors are OpenAI-shaped: {"error": {message, type, param, code}}.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from router.core import Chunk
from router.errors import APIError
from router.limits import retry_after
from router.logprobs import LogprobFormatter, merge
from router.tool_calls import ToolCallStream

DONE_EVENT = "data: [DONE]\n\n"


def error_response(exc: APIError) -> JSONResponse:
    """An APIError as its HTTP response: the OpenAI error body, and Retry-After on 429."""
    headers = dict(exc.headers or {})
    if exc.status == 429:
        headers["Retry-After"] = str(retry_after(exc.retry_after or 1))
    return JSONResponse(error_body(exc), status_code=exc.status, headers=headers)


def error_body(exc: APIError) -> dict[str, Any]:
    """`code` is OpenAI's: a string or null (vLLM sends the status there, an int, which
    clients typed on OpenAI's schema fail to read); the status is the HTTP status's."""
    return {"error": {"message": exc.message, "type": exc.kind, "param": exc.param, "code": exc.code}}


def error_event(exc: APIError) -> str:
    return "data: " + json.dumps(error_body(exc)) + "\n\n"


@dataclass
class _Choice:
    """One sequence's answer as it builds up."""

    formatter: LogprobFormatter | None
    tools: ToolCallStream | None
    texts: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    num_tokens: int = 0
    cached: int = 0
    cumulative_logprob: float = 0.0  # of its sampled tokens: best_of ranks by it
    sent_role: bool = False  # streamed chat: the role goes in each choice's first delta only
    prompt_logprobs: list | None = None  # vLLM's `prompt_logprobs` of the choice, when asked


class ResponseShaper:
    """The bodies and events of one request's response; one id and creation time.

    `prompt_tokens`: each prompt's length. The request sampled `sampled` sequences per
    prompt and answers the `n` best (sampled > n: best_of, ranked by the cumulative
    logprob of their tokens; never streamed). Choice index = prompt index * n + i, as
    OpenAI numbers batched prompts. `formatter` and `tools` make one per choice (None:
    no logprobs answered; no tool calls)."""

    def __init__(self, chat: bool, model: str, prompt_tokens: list[int],
                 formatter: Callable[[], LogprobFormatter] | None, tools: Callable[[], ToolCallStream] | None = None,
                 n: int = 1, sampled: int = 1) -> None:
        self.chat, self.model, self.prompt_tokens = chat, model, prompt_tokens
        self.n, self.sampled = n, sampled
        self._formatter, self._tools = formatter, tools
        self._choices: dict[int, _Choice] = {}  # by sequence index
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _choice_of(self, chunk: Chunk) -> _Choice:
        choice = self._choices.get(chunk.index)
        if choice is None:
            choice = self._choices[chunk.index] = _Choice(self._formatter() if self._formatter else None,
                                                          self._tools() if self._tools else None)
        choice.num_tokens, choice.cached = chunk.num_tokens, max(choice.cached, chunk.cached)
        # (An echoed prompt's first entry has none; best_of never echoes prompt logprobs.)
        choice.cumulative_logprob += sum(entry[0] for entry in chunk.logprobs if entry[0] is not None)
        if chunk.finish_reason is not None:
            choice.finish_reason = chunk.finish_reason
        return choice

    def body(self, chunks: list[Chunk]) -> dict[str, Any]:
        """The non-streamed response: each sequence's chunks joined, the n best of each
        prompt's answered."""
        for chunk in chunks:
            if not chunk.admission:
                choice = self._choice_of(chunk)
                choice.texts.append(chunk.text)
                if chunk.vllm_prompt_logprobs is not None:  # vLLM's field (router/logprobs.py)
                    choice.prompt_logprobs = chunk.vllm_prompt_logprobs
                if choice.formatter is not None:
                    choice.logprobs.append(choice.formatter.format(chunk.token_ids, chunk.logprobs))
        answered = self._answered()
        out = [self._whole(index, self._choices[seq]) for index, seq in enumerate(answered)]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": out,
                "usage": self.usage([self._choices[seq] for seq in answered])}

    def _answered(self) -> list[int]:
        """The sequences answered, in choice order: per prompt, the n of highest
        cumulative logprob (all of them when n were sampled), ties to the lower index."""
        order: list[int] = []
        for p in range(len(self.prompt_tokens)):
            seqs: Sequence[int] = range(p * self.sampled, (p + 1) * self.sampled)
            if self.sampled > self.n:
                seqs = sorted(seqs, key=lambda s: (-self._choices[s].cumulative_logprob, s))[:self.n]
            order += seqs
        return order

    def _whole(self, index: int, choice: _Choice) -> dict[str, Any]:
        text, logprobs = "".join(choice.texts), merge(choice.logprobs)
        if choice.tools is None:
            shaped = self._shape(index, text, choice.finish_reason, False, logprobs)
            if choice.prompt_logprobs is not None:
                shaped["prompt_logprobs"] = choice.prompt_logprobs
            return shaped
        choice.tools.feed(text)
        _, reason = choice.tools.finish(choice.finish_reason or "stop")
        return {"index": index, "message": choice.tools.message(), "finish_reason": reason, "logprobs": logprobs}

    def event(self, chunk: Chunk) -> str:
        """One chunk as streamed events, of its own choice (streamed, a sequence's index
        is its choice's): with tools none, one, or several, as the text turns into
        content and tool-call deltas. The admission chunk: none."""
        if chunk.admission:
            return ""
        choice = self._choice_of(chunk)
        logprobs = choice.formatter.format(chunk.token_ids, chunk.logprobs) if choice.formatter else None
        if choice.tools is not None:
            return self._tool_events(chunk.index, choice, choice.tools, chunk, logprobs)
        shaped = self._shape(chunk.index, chunk.text, chunk.finish_reason, True, logprobs, choice)
        if chunk.vllm_prompt_logprobs is not None:
            shaped["prompt_logprobs"] = chunk.vllm_prompt_logprobs
        return self._event([shaped])

    def _event(self, choices: list[dict[str, Any]]) -> str:
        return "data: " + json.dumps({"id": self.id, "object": self._chunk_kind, "created": self.created,
                                      "model": self.model, "choices": choices}) + "\n\n"

    def _tool_events(self, index: int, choice: _Choice, tools: ToolCallStream, chunk: Chunk,
                     logprobs: dict[str, Any] | None) -> str:
        """OpenAI's shape: the role in the first delta only; a tool call's first delta
        has its id, type and name, later ones argument fragments; the finish_reason in
        the last event. A chunk's logprobs ride on its first event. `tools`: the choice's."""
        deltas = tools.feed(chunk.text)
        reason = None
        if chunk.finish_reason is not None:
            more, reason = tools.finish(chunk.finish_reason)
            deltas += more
        if not deltas and (reason is not None or logprobs is not None):
            deltas = [{}]
        events = []
        for i, delta in enumerate(deltas):
            if not choice.sent_role:
                delta, choice.sent_role = {"role": "assistant", **delta}, True
            events.append(self._event([{"index": index, "delta": delta,
                                        "finish_reason": reason if i == len(deltas) - 1 else None,
                                        "logprobs": logprobs if i == 0 else None}]))
        return "".join(events)

    def usage_event(self) -> str:
        """The stream's last event before [DONE], with stream_options.include_usage."""
        return "data: " + json.dumps({"id": self.id, "object": self._chunk_kind, "created": self.created,
                                      "model": self.model, "choices": [],
                                      "usage": self.usage(list(self._choices.values()))}) + "\n\n"

    def usage(self, answered: list[_Choice]) -> dict[str, Any]:
        """Each prompt counted once; the tokens of the choices answered (best_of: not
        those of the sequences left out); the prompts' prefix-cache hits."""
        prompt, completion = sum(self.prompt_tokens), sum(c.num_tokens for c in answered)
        cached = [0] * len(self.prompt_tokens)
        for seq, choice in self._choices.items():
            cached[seq // self.sampled] = max(cached[seq // self.sampled], choice.cached)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(cached)}}

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _shape(self, index: int, text: str, reason: str | None, delta: bool, logprobs: dict[str, Any] | None,
               choice: _Choice | None = None) -> dict[str, Any]:
        if not self.chat:
            return {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}
        if not delta:
            return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                    "logprobs": logprobs}
        content: dict[str, Any] = {"content": text}
        if choice is not None and not choice.sent_role:
            content, choice.sent_role = {"role": "assistant", **content}, True
        return {"index": index, "delta": content, "finish_reason": reason, "logprobs": logprobs}
