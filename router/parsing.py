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
import contextlib
import functools
import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from engine.sampling_params import SamplingParams, bad_words_token_ids
from router import request_body, structured
from router.adapters import Adapter
from router.bounds import InputBounds, check_bounds
from router.config import ModelLimits
from router.errors import APIError, TokenizerBusy
from router.limits import retry_after
from router.logprobs import PromptScoring, prompt_scoring
from router.model_names import ServedModels
from router.slo import NO_TARGETS, Targets, body_targets

T = TypeVar("T")


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
    # Choices answered per prompt; params.n sequences are sampled per prompt (best_of:
    # more, the n best answered, ranked by logprobs the client may not have asked for).
    n: int = field(default=1, kw_only=True)
    rank_only_logprobs: bool = field(default=False, kw_only=True)  # params.logprobs set only to rank best_of
    # Batched prompts (completions): every prompt's ids, prompt_ids the first; None: one prompt.
    batch: list[list[int]] | None = field(default=None, kw_only=True)

    @property
    def prompts(self) -> list[list[int]]:
        return self.batch if self.batch is not None else [self.prompt_ids]
    priority: int = field(default=0, kw_only=True)  # lower is scheduled first (request_body.priority)
    lora: Adapter | None = field(default=None, kw_only=True)  # the LoRA adapter its `model` names; None: the model
    targets: Targets = field(default=NO_TARGETS, kw_only=True)  # slo_ttft_ms / slo_tpot_ms as the body sets them


@dataclass(frozen=True)
class CompletionRequest(GenerateRequest):
    # As sent: text (tokenized into prompt_ids) or the token ids themselves; batched: a list of either.
    prompt: str | list[int] | list[str] | list[list[int]]
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
    None: unbounded). `models`: the names a request's `model` may give (None: the model
    path, router/model_names.py)."""

    def __init__(self, tokenizer: Any, limits: ModelLimits, kv_pool_tokens: Callable[[], list[int]],
                 bounds: InputBounds | None = None, models: ServedModels | None = None) -> None:
        self.tokenizer = tokenizer
        self.bounds = bounds
        self._tokenizing = 0  # requests waiting for the tokenizer thread or in it
        self._tokenize_s = 0.0  # a moving average of one call's seconds, for Retry-After
        self.limits = limits
        self.models = models or ServedModels.of(None, limits.model, limits.max_model_len)
        self.kv_pool_tokens = kv_pool_tokens
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        # The longest vocabulary entry: its spelling has at least one character per
        # character of text it stands for (byte-level BPE: one per byte), so this
        # bounds how many characters max_model_len tokens can hold.
        self.max_token_chars = max(map(len, tokenizer.get_vocab()), default=1)

    async def completion(self, raw: bytes) -> CompletionRequest:
        body, stream, include_usage = self._body(raw, chat=False)
        prompts = request_body.prompt_input(body.get("prompt"), self.limits.vocab_size)
        n, best_of = self._choices(body, False, stream, len(prompts))
        texts = [p for p in prompts if isinstance(p, str)]
        for text in texts:
            self._check_chars(len(text), "prompt")
        if texts:
            batch = await self._tokenize(lambda: [self.tokenizer.encode(text) for text in texts])
            for i, ids in enumerate(batch):
                request_body.check_tokenized(ids, self.limits.vocab_size, f"prompt[{i}]" if len(batch) > 1 else "prompt",
                                             "prompt")
        else:
            batch = prompts
        sampling_body, scoring = prompt_scoring(body)
        constraint = structured.constraint(body, None)
        with _counted(sum(map(len, batch))):
            options, names = self._sampling_options(sampling_body, False, max(map(len, batch)), "prompt")
            # best_of > n: the sequences carry logprobs to rank them by, left out of the
            # answer when the client asked none.
            rank_only = best_of > n and options["logprobs"] is None
            options.update(n=best_of, logprobs=0 if rank_only else options["logprobs"])
            if scoring is not None and scoring.engine_count is not None:
                options["prompt_logprobs"] = scoring.engine_count
            params = await self._params(options, names, constraint, max(map(len, batch)))
        if params.prompt_logprobs is not None and best_of > 1:  # a group's sequences compute only the last prompt token
            raise APIError(400, f"n (or best_of) > 1 ({best_of} sequences) with prompt logprobs (echo with "
                                "logprobs, or prompt_logprobs) is not supported: send n=1", "n")
        return CompletionRequest(batch[0], params, stream, include_usage, prompts[0] if len(prompts) == 1 else prompts,
                                 constraint_source=constraint.source if constraint else None, n=n, rank_only_logprobs=rank_only,
                                 batch=batch if len(batch) > 1 else None,
                                 priority=request_body.priority(body), targets=body_targets(body), scoring=scoring,
                                 lora=self.models.check(body))

    async def chat(self, raw: bytes) -> ChatRequest:
        body, stream, include_usage = self._body(raw, chat=True)
        tools = structured.tool_choice(body)
        messages = request_body.chat_messages(body.get("messages"), set(tools.parameters) if tools else None)
        self._check_chars(chat_chars(messages, tools), "messages")
        add_generation_prompt = request_body.flag(body, "add_generation_prompt", True)
        constraint = structured.constraint(body, tools)
        # The template is shown the tools even with tool_choice "none" (vLLM's default).
        template_tools = tools.definitions if tools is not None else None

        def tokenize() -> list[int]:
            # Encoded without special tokens: the template already holds them (as LLM.chat does).
            text = chat_text(self.tokenizer, messages, template_tools, add_generation_prompt)
            return self.tokenizer.encode(text, add_special_tokens=False)
        try:
            ids = await self._tokenize(tokenize)
        except RecursionError:  # the template walks what the bounds let through; never a 500
            raise APIError(400, "messages are nested too deeply for the model's chat template", "messages") from None
        request_body.check_tokenized(ids, self.limits.vocab_size, "messages", "messages")
        n, _ = self._choices(body, True, stream, 1)
        with _counted(len(ids)):
            options, names = self._sampling_options(body, True, len(ids), "messages")
            options["n"] = n
            params = await self._params(options, names, constraint, len(ids))
        return ChatRequest(ids, params, stream, include_usage, messages, add_generation_prompt,
                           constraint_source=constraint.source if constraint else None, tools=tools, n=n,
                           priority=request_body.priority(body), targets=body_targets(body),
                           lora=self.models.check(body))

    def _body(self, raw: bytes, chat: bool) -> tuple[dict[str, Any], bool, bool]:
        """The JSON body, with every check that needs no tokenizer done; stream and
        stream_options.include_usage."""
        body = self.checked_json(raw)
        request_body.check_unsupported(body, chat)
        stream = request_body.flag(body, "stream", False)
        return body, stream, request_body.include_usage(body, stream)

    # --- what the endpoints beside generation share with it (router/tokenize_api.py) -------

    def checked_json(self, raw: bytes) -> dict[str, Any]:
        """The JSON body, within its bounds, naming a model served here (if any)."""
        body = request_body.read_json(raw)
        if self.bounds is not None:
            check_bounds(body, self.bounds)
        self.models.check(body)
        return body

    def check_chars(self, num_chars: int, param: str) -> None:
        self._check_chars(num_chars, param)

    async def in_tokenizer_thread(self, call: Callable[..., Any], *args: Any) -> Any:
        """call(*args) in the tokenizer's one thread, its queue bounded (_tokenize)."""
        return await self._tokenize(call, *args)

    def _sampling_options(self, body: dict[str, Any], chat: bool, num_prompt_tokens: int,
                          prompt_field: str) -> tuple[dict[str, Any], dict[str, str]]:
        """The body's sampling fields (request_body.sampling_options), once the prompt
        is known to leave room for output. Chat without max_tokens generates until EOS
        or a full context, as vLLM does; completions keep OpenAI's default of 16. That
        default is also capped by the smallest KV pool a decode worker reported, since a
        request that cannot fit in one is refused, and by a key's tokens in flight
        (router.key_tokens_in_flight), likewise."""
        room = self._room(num_prompt_tokens, prompt_field)
        default = None
        if chat:  # prompt + max_tokens must fit in a decode worker's KV pool, and a key's tokens in flight
            fits = [room] + [tokens - num_prompt_tokens for tokens in self.kv_pool_tokens()]
            if self.bounds is not None and self.bounds.max_tokens_in_flight is not None:
                fits.append(self.bounds.max_tokens_in_flight - num_prompt_tokens)
            default = max(1, min(fits))
        return request_body.sampling_options(body, chat, default)

    async def _params(self, options: dict[str, Any], names: dict[str, str], constraint: structured.Constraint | None,
                      num_prompt_tokens: int) -> SamplingParams:
        """The request's SamplingParams, built once from the body's fields and those the
        parser set; then checked against the context length and, with bad_words
        tokenized, the vocabulary."""
        if constraint is not None:
            options["structured_outputs"] = constraint.params
        params = request_body.sampling_params(options, names)
        if num_prompt_tokens + params.max_tokens > self.limits.max_model_len:
            name = names.get("max_tokens", "max_tokens")
            raise APIError(400, f"prompt ({num_prompt_tokens} tokens) + {name} ({params.max_tokens}) = "
                                f"{num_prompt_tokens + params.max_tokens} exceeds the model's context length "
                                f"{self.limits.max_model_len}", name)
        if params.bad_words:
            # The tokenizer's sequences for them, added to the params just built, in
            # place (as vLLM's update_from_tokenizer does): token ids from the tokenizer
            # need no second validation; the vocabulary check below covers them.
            encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
            found = await self._tokenize(bad_words_token_ids, params.bad_words, encode)
            params.bad_words_token_ids += [s for s in found if s not in params.bad_words_token_ids]
        request_body.check_vocab(params, self.limits.vocab_size)
        return params

    def _room(self, num_prompt_tokens: int, prompt_field: str) -> int:
        """Tokens of output the context leaves after the prompt; 400 if none. With
        _params' check of prompt + max_tokens, the one owner of the context length for
        served requests (the decode worker only guards it: decode_worker/guards.py)."""
        room = self.limits.max_model_len - num_prompt_tokens
        if room < 1:
            raise APIError(400, f"prompt has {num_prompt_tokens} tokens, but the model's context length is "
                                f"{self.limits.max_model_len} (prompt must leave room for output)", prompt_field)
        return room

    def _choices(self, body: dict[str, Any], chat: bool, stream: bool, num_prompts: int) -> tuple[int, int]:
        """(n, best_of), each within router.max_n, and the request's sequences (prompts x
        best_of) within router.max_sequences."""
        bounds = self.bounds or InputBounds.unbounded()
        n, best_of = request_body.choices(body, chat, stream, bounds.max_n)
        if num_prompts * best_of > bounds.max_sequences:
            raise APIError(400, f"{num_prompts} prompts x {best_of} sequences each = {num_prompts * best_of} "
                                f"sequences: more than a request may sample (router.max_sequences = "
                                f"{bounds.max_sequences})", "prompt")
        return n, best_of

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

    async def _tokenize(self, call: Callable[..., T], *args: Any) -> T:
        """Run a tokenizer call off the event loop, so that streams, health pings and
        /health go on meanwhile (the fast tokenizer releases the GIL). One thread:
        tokenizer calls never run concurrently (HF fast tokenizers are not safe for
        that), and the character cap bounds how long one call may take. With
        bounds.max_tokenize_queue requests already waiting: 429, its Retry-After the
        time the queue takes at the recent pace."""
        waiting = self._tokenizing
        if self.bounds is not None and waiting >= self.bounds.max_tokenize_queue:
            raise TokenizerBusy(429, f"{waiting} requests are waiting for the tokenizer (router.max_tokenize_queue); "
                                     "retry later", kind="rate_limit_error",
                                retry_after=retry_after(waiting * self._tokenize_s))

        def timed() -> T:  # in the tokenizer's one thread: the only writer of _tokenize_s
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


@contextlib.contextmanager
def _counted(prompt_tokens: int) -> Iterator[None]:
    """An APIError raised inside says the prompt's length (for the access log)."""
    try:
        yield
    except APIError as exc:
        exc.prompt_tokens = prompt_tokens
        raise


def chat_text(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
              add_generation_prompt: bool) -> str:
    """The chat template rendered for these messages (and tool definitions). A role
    the template does not know is its to refuse, not ours: vLLM takes custom roles
    (its CustomChatCompletionMessageParam) and so do we. A template's refusal
    (raise_exception, e.g. "roles must alternate") is the request's 400, as in vLLM."""
    import jinja2  # what transformers renders chat templates with; not its hard dependency

    if not getattr(tokenizer, "chat_template", None):  # a base model's (vLLM refuses it too)
        raise APIError(400, "this model has no chat template: send the prompt to /v1/completions, "
                            "or serve the model with a tokenizer that has one", "messages")
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as exc:
        raise APIError(400, f"the model's chat template refused these messages: {exc}", "messages") from None


def chat_chars(messages: list[dict[str, Any]], tools: structured.ToolChoice | None) -> int:
    """The characters a chat template may render: contents, tool calls' arguments and
    the tool definitions."""
    chars = sum(len(m["content"]) for m in messages)
    chars += sum(len(json.dumps(c["function"])) for m in messages for c in m.get("tool_calls", ()))
    return chars + (len(json.dumps(tools.definitions)) if tools is not None else 0)
