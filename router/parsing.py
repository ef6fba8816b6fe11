"""Each HTTP request body parsed once, into a typed request ready to run: checked
(router/request_body.py, field by field), tokenized (the chat template too, off the event
loop) and its SamplingParams checked against the context length.

The checks run in one fixed order, and the first problem found is the one answered
(HTTP 400 naming the field): the JSON itself, its bounds (router/bounds.py: counts,
string lengths, nesting), model, unsupported parameters, stream and
stream_options, the prompt or messages (their shape, then their length in characters,
then, for chat, add_generation_prompt), the prompt's length in tokens, then the sampling
fields. Tests pin which error wins, so keep the order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from engine.sampling_params import SamplingParams
from router import request_body, structured
from router.bounds import InputBounds, check_bounds
from router.config import ModelLimits
from router.errors import APIError
from router.limits import retry_after
from router.logprobs import PromptScoring, prompt_scoring


@dataclass(frozen=True)
class GenerateRequest:
    """What either endpoint runs: Router.run(prompt_ids, params), then a response shaped
    by router/responses.py."""

    prompt_ids: list[int]
    params: SamplingParams  # max_tokens fits the context; logprobs: alternatives per token (None: no logprobs)
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last streamed event with the usage
    chat: ClassVar[bool]
    # Where the client described params.structured_outputs (a decode worker's error about
    # it is said with this name); None: no constraint.
    constraint_source: str | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class CompletionRequest(GenerateRequest):
    prompt: str | list[int]  # as sent: text (tokenized into prompt_ids) or the token ids themselves
    chat: ClassVar[bool] = False
    scoring: PromptScoring | None = field(default=None, kw_only=True)  # echo, prompt logprobs; None: neither


@dataclass(frozen=True)
class ChatRequest(GenerateRequest):
    messages: list[dict[str, Any]]  # {role, content}, content a string (text parts joined)
    add_generation_prompt: bool  # prompt_ids end with the template's assistant turn opening
    chat: ClassVar[bool] = True
    tools: structured.ToolChoice | None = field(default=None, kw_only=True)  # None: no tools defined


class RequestParser:
    """Parses the bodies of /v1/completions and /v1/chat/completions for one model.

    `kv_pool_tokens` gives the tokens each decode worker's KV pool holds, for those that
    reported it: chat's default max_tokens must fit the smallest. `bounds`: the limits
    of router/bounds.py and of the tokenizer's queue (the Router gives the config's;
    None: unbounded)."""

    def __init__(self, tokenizer: Any, limits: ModelLimits, kv_pool_tokens: Callable[[], list[int]],
                 bounds: InputBounds | None = None) -> None:
        self.tokenizer = tokenizer
        self.bounds = bounds
        self._tokenizing = 0  # requests waiting for the tokenizer thread or in it
        self._tokenize_s = 0.0  # a moving average of one call's seconds, for Retry-After
        self.limits = limits
        self.model_name = limits.model
        self.served_names = {limits.model, Path(limits.model).name}
        self.kv_pool_tokens = kv_pool_tokens
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        # The longest vocabulary entry: its spelling has at least one character per
        # character of text it stands for (byte-level BPE: one per byte), so this
        # bounds how many characters max_model_len tokens can hold.
        self.max_token_chars = max(map(len, tokenizer.get_vocab()), default=1)

    async def completion(self, raw: bytes) -> CompletionRequest:
        body, stream, include_usage = self._body(raw, chat=False)
        prompt = request_body.prompt_input(body.get("prompt"), self.limits.vocab_size)
        if isinstance(prompt, list):
            ids = prompt
        else:
            self._check_chars(len(prompt), "prompt")
            ids = await self._tokenize(self.tokenizer.encode, prompt)
        sampling_body, scoring = prompt_scoring(body)
        params = self._sampling_params(sampling_body, False, len(ids), "prompt")
        if scoring is not None:
            params = dataclasses.replace(params, prompt_logprobs=scoring.engine_count)
        params, source = _constrained(params, structured.constraint(body, None))
        return CompletionRequest(ids, params, stream, include_usage, prompt, constraint_source=source,
                                 scoring=scoring)

    async def chat(self, raw: bytes) -> ChatRequest:
        body, stream, include_usage = self._body(raw, chat=True)
        tools = structured.tool_choice(body)
        messages = request_body.chat_messages(body.get("messages"), set(tools.parameters) if tools else None)
        self._check_chars(_chat_chars(messages, tools), "messages")
        add_generation_prompt = request_body.flag(body, "add_generation_prompt", True)
        constraint = structured.constraint(body, tools)
        # The template is shown the tools even with tool_choice "none" (vLLM's default).
        template_tools = tools.definitions if tools is not None else None

        def tokenize() -> list[int]:
            # Rendered to text, then encoded without special tokens: the template
            # already holds them (as LLM.chat does).
            text = self.tokenizer.apply_chat_template(messages, tools=template_tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
            return self.tokenizer.encode(text, add_special_tokens=False)
        try:
            ids = await self._tokenize(tokenize)
        except RecursionError:  # the template walks what the bounds let through; never a 500
            raise APIError(400, "messages are nested too deeply for the model's chat template", "messages") from None
        params, source = _constrained(self._sampling_params(body, True, len(ids), "messages"), constraint)
        return ChatRequest(ids, params, stream, include_usage, messages, add_generation_prompt,
                           constraint_source=source, tools=tools)

    def _body(self, raw: bytes, chat: bool) -> tuple[dict[str, Any], bool, bool]:
        """The JSON body, with every check that needs no tokenizer done; stream and
        stream_options.include_usage."""
        body = request_body.read_json(raw)
        if self.bounds is not None:
            check_bounds(body, self.bounds)
        request_body.check_model(body, self.served_names, self.model_name)
        request_body.check_unsupported(body, chat)
        stream = request_body.flag(body, "stream", False)
        return body, stream, request_body.include_usage(body)

    def _sampling_params(self, body: dict[str, Any], chat: bool, num_prompt_tokens: int,
                         prompt_field: str) -> SamplingParams:
        """The request's SamplingParams, checked against the context length here (the
        decode worker checks again) so the error can name the field. Chat without
        max_tokens generates until EOS or a full context, as vLLM does; completions
        keep OpenAI's default of 16. That default is also capped by the smallest KV pool a
        decode worker reported, since a request that cannot fit in one is refused, and by
        a key's tokens in flight (router.key_tokens_in_flight), likewise."""
        max_model_len = self.limits.max_model_len
        room = max_model_len - num_prompt_tokens
        if room < 1:
            raise APIError(400, f"prompt has {num_prompt_tokens} tokens, but the model's context length is "
                                f"{max_model_len} (prompt must leave room for output)", prompt_field)
        default = None
        if chat:  # prompt + max_tokens must fit in a decode worker's KV pool, and a key's tokens in flight
            fits = [room] + [tokens - num_prompt_tokens for tokens in self.kv_pool_tokens()]
            if self.bounds is not None and self.bounds.max_tokens_in_flight is not None:
                fits.append(self.bounds.max_tokens_in_flight - num_prompt_tokens)
            default = max(1, min(fits))
        params = request_body.sampling_params(body, chat, default)
        if params.max_tokens > room:
            alias = body.get("max_tokens") is None and body.get(request_body.MAX_TOKENS_ALIAS) is not None
            name = request_body.MAX_TOKENS_ALIAS if alias else "max_tokens"
            raise APIError(400, f"prompt ({num_prompt_tokens} tokens) + {name} ({params.max_tokens}) = "
                                f"{num_prompt_tokens + params.max_tokens} exceeds the model's context length "
                                f"{max_model_len}", name)
        return params

    def _check_chars(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing it, text that cannot fit the context: no token of
        this vocabulary covers more than max_token_chars characters, so such text has
        more than max_model_len tokens. Tokenizing megabytes would only take seconds to
        find that out."""
        max_model_len = self.limits.max_model_len
        limit = max_model_len * self.max_token_chars
        if num_chars > limit:
            raise APIError(400, f"{param} has {num_chars} characters: more than the model's context length "
                                f"({max_model_len} tokens) can hold (at most {limit} characters)", param)

    async def _tokenize(self, call: Callable[..., list[int]], *args: Any) -> list[int]:
        """Run a tokenizer call off the event loop, so that streams, health pings and
        /health go on meanwhile (the fast tokenizer releases the GIL). One thread:
        tokenizer calls never run concurrently (HF fast tokenizers are not safe for
        that), and the character cap bounds how long one call may take. With
        bounds.max_tokenize_queue requests already waiting: 429, its Retry-After the
        time the queue takes at the recent pace."""
        waiting = self._tokenizing
        if self.bounds is not None and waiting >= self.bounds.max_tokenize_queue:
            raise APIError(429, f"{waiting} requests are waiting for the tokenizer (router.max_tokenize_queue); "
                                "retry later", kind="rate_limit_error",
                           retry_after=retry_after(waiting * self._tokenize_s))

        def timed() -> list[int]:  # in the tokenizer's one thread: the only writer of _tokenize_s
            start = time.monotonic()
            try:
                return call(*args)
            finally:
                self._tokenize_s = 0.8 * self._tokenize_s + 0.2 * (time.monotonic() - start)

        self._tokenizing += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, timed)
        finally:
            self._tokenizing -= 1


def _constrained(params: SamplingParams, constraint: structured.Constraint | None) -> tuple[SamplingParams, str | None]:
    if constraint is None:
        return params, None
    return dataclasses.replace(params, structured_outputs=constraint.params), constraint.source


def _chat_chars(messages: list[dict[str, Any]], tools: structured.ToolChoice | None) -> int:
    """The characters a chat template may render: contents, tool calls' arguments and
    the tool definitions."""
    chars = sum(len(m["content"]) for m in messages)
    chars += sum(len(json.dumps(c["function"])) for m in messages for c in m.get("tool_calls", ()))
    return chars + (len(json.dumps(tools.definitions)) if tools is not None else 0)
