"""OpenAI response bodies and server-sent events, from a request's chunks (Router.run).

Completions answer `text_completion` objects with `choices[i].text`; chat answers
`chat.completion` objects with `choices[i].message` (streamed: `chat.completion.chunk`
with `choices[i].delta`). A stream is one `data: {json}` event per chunk, then, with
stream_options.include_usage, one with empty choices and the usage, then
`data: [DONE]`; a stream broken after its first event ends with an error event before
[DONE] (as vLLM does). Errors are OpenAI-shaped: {"error": {message, type, param, code}}.
"""

from __future__ import annotations

import json
import time
import uuid
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
    code = exc.code if exc.code is not None else exc.status
    return {"error": {"message": exc.message, "type": exc.kind, "param": exc.param, "code": code}}


def error_event(exc: APIError) -> str:
    return "data: " + json.dumps(error_body(exc)) + "\n\n"


class ResponseShaper:
    """The bodies and events of one request's response; one id and creation time."""

    def __init__(self, chat: bool, model: str, num_prompt_tokens: int,
                 formatter: LogprobFormatter | None, tools: ToolCallStream | None = None) -> None:
        self.chat, self.model, self.num_prompt_tokens = chat, model, num_prompt_tokens
        self.formatter = formatter  # None: the request asked for no logprobs
        self.tools = tools  # chat with tools it may call: its text read as tool calls
        self._sent_role = False
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def body(self, chunks: list[Chunk]) -> dict[str, Any]:
        """The non-streamed response: every chunk's text joined."""
        parts = [p for p in map(self._logprobs, chunks) if p is not None]
        last = chunks[-1]
        text = "".join(c.text for c in chunks)
        if self.tools is None:
            choice = self._choice(text, last.finish_reason, False, merge(parts))
            if chunks[0].vllm_prompt_logprobs is not None:  # vLLM's field (router/logprobs.py)
                choice["prompt_logprobs"] = chunks[0].vllm_prompt_logprobs
        else:
            self.tools.feed(text)
            _, reason = self.tools.finish(last.finish_reason or "stop")
            choice = {"index": 0, "message": self.tools.message(), "finish_reason": reason,
                      "logprobs": merge(parts)}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": self.usage(last.num_tokens)}

    def event(self, chunk: Chunk) -> str:
        """One chunk as streamed events (with tools: none, one, or several, as the text
        turns into content and tool-call deltas)."""
        if self.tools is not None:
            return self._tool_events(chunk)
        choice = self._choice(chunk.text, chunk.finish_reason, True, self._logprobs(chunk))
        if chunk.vllm_prompt_logprobs is not None:
            choice["prompt_logprobs"] = chunk.vllm_prompt_logprobs
        return self._event([choice])

    def _event(self, choices: list[dict[str, Any]]) -> str:
        return "data: " + json.dumps({"id": self.id, "object": self._chunk_kind, "created": self.created,
                                      "model": self.model, "choices": choices}) + "\n\n"

    def _tool_events(self, chunk: Chunk) -> str:
        """OpenAI's shape: the role in the first delta only; a tool call's first delta
        has its id, type and name, later ones argument fragments; the finish_reason in
        the last event. A chunk's logprobs ride on its first event."""
        deltas = self.tools.feed(chunk.text)
        reason = None
        if chunk.finish_reason is not None:
            more, reason = self.tools.finish(chunk.finish_reason)
            deltas += more
        logprobs = self._logprobs(chunk)
        if not deltas and (reason is not None or logprobs is not None):
            deltas = [{}]
        events = []
        for i, delta in enumerate(deltas):
            if not self._sent_role:
                delta, self._sent_role = {"role": "assistant", **delta}, True
            events.append(self._event([{"index": 0, "delta": delta,
                                        "finish_reason": reason if i == len(deltas) - 1 else None,
                                        "logprobs": logprobs if i == 0 else None}]))
        return "".join(events)

    def usage_event(self, num_tokens: int) -> str:
        """The stream's last event before [DONE], with stream_options.include_usage."""
        return "data: " + json.dumps({"id": self.id, "object": self._chunk_kind, "created": self.created,
                                      "model": self.model, "choices": [],
                                      "usage": self.usage(num_tokens)}) + "\n\n"

    def usage(self, num_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": num_tokens,
                "total_tokens": self.num_prompt_tokens + num_tokens}

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _logprobs(self, chunk: Chunk) -> dict[str, Any] | None:
        return self.formatter.format(chunk.token_ids, chunk.logprobs) if self.formatter else None

    def _choice(self, text: str, reason: str | None, delta: bool, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}
        key = "delta" if delta else "message"
        return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": reason,
                "logprobs": logprobs}
