"""Bounds on what one request body may hold, checked right after its JSON is read and
before anything else looks at it (the body's byte size is bounded before, by
router/http_guard.py).

- `messages` (chat): at most max_messages entries.
- `stop`, `stop_token_ids` and `bad_words`: at most max_stop entries each.
- Every string of the fields pdserve reads (READ_FIELDS), and every object key there,
  at any depth: at most max_string_chars characters. The prompt and the messages'
  contents (text parts, a history tool call's arguments) are not: the context length
  bounds those (RequestParser._check_chars), and a prompt may rightly be longer.
  Other fields are ignored or refused unless "off" and never read, so only
  max_body_bytes bounds them.
- Nesting in those fields: at most MAX_DEPTH levels. Deeper JSON is no request anyone
  sends, and the code that reads a schema or shows a value recurses.

Each is a 400 naming the field. The walk is iterative (a body nested as deep as the
JSON reader allows cannot overflow Python's stack here), and it skips through lists
of scalars at C speed: it runs on the event loop, so it must cost little beside
json.loads itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress, repeat
from typing import Any, Protocol

from router.errors import APIError
from router.request_body import MAX_DEPTH, MAX_TOKENS_ALIAS, SAMPLING_FIELDS

# JSON objects and arrays in one field: far above any request's (a long conversation, a
# large schema), and it bounds the walk's time on the event loop.
MAX_CONTAINERS = 100_000
# The fields whose values pdserve reads (request_body.py, structured.py, logprobs.py);
# not the prompt, which the context length bounds.
READ_FIELDS = ("model", "messages", "tools", "tool_choice", "parallel_tool_calls", "response_format",
               "structured_outputs", "stream", "stream_options", "add_generation_prompt", "logprobs",
               "top_logprobs", MAX_TOKENS_ALIAS, *SAMPLING_FIELDS)
# Where, under `messages`, a string is the conversation's text (bounded by the context
# length): messages[i].content, its parts' .text, a tool call's function.arguments.
# A place in a field: (parent place, key or index); None: the field itself.
Place = tuple[Any, Any] | None
_CONTAINERS = {dict, list}
_TEXT_PATHS = {("content",), ("content", "*", "text"), ("tool_calls", "*", "function", "arguments")}


class BoundSettings(Protocol):
    """The fields of cluster.router_config.RouterConfig read here (documented and validated there)."""

    @property
    def max_messages(self) -> int: ...

    @property
    def max_stop(self) -> int: ...

    @property
    def max_string_chars(self) -> int: ...

    @property
    def max_tokenize_queue(self) -> int: ...

    @property
    def key_tokens_in_flight(self) -> int | None: ...

    @property
    def max_n(self) -> int: ...

    @property
    def max_sequences(self) -> int: ...


@dataclass(frozen=True)
class InputBounds:
    max_messages: int
    max_stop: int
    max_string_chars: int
    max_tokenize_queue: int  # requests waiting for (or in) the tokenizer; beyond: 429
    # A key's tokens in flight (router/limits.py), which a chat's default max_tokens
    # must fit; None: no such limit.
    max_tokens_in_flight: int | None = None
    max_n: int = 16  # n and best_of: sequences sampled per prompt
    max_sequences: int = 256  # prompts x best_of (or n) of one request

    @classmethod
    def of(cls, settings: BoundSettings) -> InputBounds:
        return cls(settings.max_messages, settings.max_stop, settings.max_string_chars, settings.max_tokenize_queue,
                   settings.key_tokens_in_flight, settings.max_n, settings.max_sequences)

    @classmethod
    def unbounded(cls) -> InputBounds:
        """For a parser given no bounds: nothing bounded but the fan-out, at its defaults."""
        inf = 2**63
        return cls(inf, inf, inf, inf)


def check_bounds(body: dict[str, Any], bounds: InputBounds) -> None:
    """APIError(400) naming the first field of `body` past one of the bounds."""
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > bounds.max_messages:
        raise APIError(400, f"messages has {len(messages)} entries; at most {bounds.max_messages} are accepted "
                            "(router.max_messages)", "messages")
    for name in ("stop", "stop_token_ids", "bad_words"):
        value = body.get(name)
        if isinstance(value, list) and len(value) > bounds.max_stop:
            raise APIError(400, f"{name} has {len(value)} entries; at most {bounds.max_stop} are accepted "
                                "(router.max_stop)", name)
    limit = bounds.max_string_chars
    for name in READ_FIELDS:
        if name in body:
            _walk(body[name], name, limit)


def _walk(root: Any, name: str, limit: int) -> None:
    """Check every string, key and nesting level of one field, depth first. A place is a
    linked path (parent, key), spelled out only for an error: most values need none."""
    if type(root) is str:
        _check_string(root, name, None, limit)
        return
    stack: list[tuple[Any, Place, int]] = [(root, None, 1)] if type(root) in _CONTAINERS else []
    containers = 0  # seen or on the stack
    too_many = APIError(400, f"{name} holds more than {MAX_CONTAINERS} JSON objects and arrays", name)
    while stack:
        value, where, depth = stack.pop()
        containers += 1
        if depth >= MAX_DEPTH:
            raise APIError(400, f"{_where(name, where)} is nested more than {MAX_DEPTH} levels deep", name)
        if type(value) is dict:
            for key, item in value.items():
                if len(key) > limit:
                    _check_string(key, name, where, limit, "a key of ")
                kind = type(item)
                if kind is str:
                    if len(item) > limit:
                        _check_string(item, name, (where, key), limit)
                elif kind in _CONTAINERS:
                    if containers + len(stack) >= MAX_CONTAINERS:
                        raise too_many
                    stack.append((item, (where, key), depth + 1))
            continue
        kinds = set(map(type, value))  # C-level passes: a long list of numbers costs next to nothing
        if str in kinds and max(map(len, compress(value, map(isinstance, value, repeat(str))))) > limit:
            i = next(i for i, item in enumerate(value) if type(item) is str and len(item) > limit)
            _check_string(value[i], name, (where, i), limit)
        if kinds & _CONTAINERS:
            if containers + len(stack) + sum(map(isinstance, value, repeat((dict, list)))) > MAX_CONTAINERS:
                raise too_many
            stack.extend((item, (where, i), depth + 1) for i, item in enumerate(value) if type(item) in _CONTAINERS)


def _keys(where: Place) -> tuple[Any, ...]:
    keys: list[Any] = []
    while where is not None:
        where, key = where
        keys.append(key)
    return tuple(reversed(keys))


def _check_string(text: str, name: str, where: Place, limit: int, what: str = "") -> None:
    if len(text) <= limit:
        return
    keys = _keys(where)
    if name == "messages" and len(keys) > 1 and tuple("*" if isinstance(k, int) else k for k in keys[1:]) in _TEXT_PATHS:
        return  # the conversation's text: the context length bounds it
    raise APIError(400, f"{what}{_where(name, where)} has {len(text)} characters; at most {limit} are accepted "
                        "(router.max_string_chars)", name)


def _where(name: str, where: Place) -> str:
    """messages[2].tool_calls[0].function.name"""
    return name + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in _keys(where))
