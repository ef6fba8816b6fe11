"""Bounds on what one request body may hold, checked right after its JSON is read and
before anything else looks at it (the body's byte size is bounded before, by
router/http_guard.py).

- `messages` (chat): at most max_messages entries.
- `stop` and `stop_token_ids`: at most max_stop entries each.
- Every other string in the body, and every object key, at any depth: at most
  max_string_chars characters. The prompt and the messages' contents (text parts, a
  history tool call's arguments) are not: the context length bounds those
  (RequestParser._check_chars), and a prompt may rightly be longer.
- Nesting: at most MAX_DEPTH levels. Deeper JSON is no request anyone sends, and the
  code that reads a schema or shows a value recurses.

Each is a 400 naming the field. The walk is iterative: a body nested as deep as the
JSON reader allows cannot overflow Python's stack here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from router.errors import APIError

MAX_DEPTH = 64
# Where, under `messages`, a string is the conversation's text (bounded by the context
# length): messages[i].content, its parts' .text, a tool call's function.arguments.
_TEXT_PATHS = {("content",), ("content", "*", "text"), ("tool_calls", "*", "function", "arguments")}


class BoundSettings(Protocol):
    """The fields of cluster.config.RouterConfig read here (documented and validated there)."""

    @property
    def max_messages(self) -> int: ...

    @property
    def max_stop(self) -> int: ...

    @property
    def max_string_chars(self) -> int: ...

    @property
    def max_tokenize_queue(self) -> int: ...


@dataclass(frozen=True)
class InputBounds:
    max_messages: int
    max_stop: int
    max_string_chars: int
    max_tokenize_queue: int  # requests waiting for (or in) the tokenizer; beyond: 429

    @classmethod
    def of(cls, settings: BoundSettings) -> "InputBounds":
        return cls(settings.max_messages, settings.max_stop, settings.max_string_chars, settings.max_tokenize_queue)


def check_bounds(body: dict[str, Any], bounds: InputBounds) -> None:
    """APIError(400) naming the first field of `body` past one of the bounds."""
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > bounds.max_messages:
        raise APIError(400, f"messages has {len(messages)} entries; at most {bounds.max_messages} are accepted "
                            "(router.max_messages)", "messages")
    for name in ("stop", "stop_token_ids"):
        value = body.get(name)
        if isinstance(value, list) and len(value) > bounds.max_stop:
            raise APIError(400, f"{name} has {len(value)} entries; at most {bounds.max_stop} are accepted "
                                "(router.max_stop)", name)
    limit = bounds.max_string_chars
    # (value, top-level field, path below it, depth); "*" stands for any list index.
    stack: list[tuple[Any, str, tuple[Any, ...], int]] = [(v, k, (), 1) for k, v in body.items() if k != "prompt"]
    for key in body:
        _check_string(key, key, (), limit, "a key of ")
    while stack:
        value, name, path, depth = stack.pop()
        if isinstance(value, str):
            if not (name == "messages" and _is_text(path)):
                _check_string(value, name, path, limit)
        elif isinstance(value, (dict, list)):
            if depth >= MAX_DEPTH:
                raise APIError(400, f"{_where(name, path)} is nested more than {MAX_DEPTH} levels deep", name)
            if isinstance(value, dict):
                for key, item in value.items():
                    _check_string(key, name, path, limit, "a key of ")
                    if isinstance(item, (str, dict, list)):
                        stack.append((item, name, (*path, key), depth + 1))
            else:
                stack.extend((item, name, (*path, i), depth + 1) for i, item in enumerate(value)
                             if isinstance(item, (str, dict, list)))


def _is_text(path: tuple[Any, ...]) -> bool:
    """path (under `messages`) is messages[i] followed by one of _TEXT_PATHS."""
    rest = tuple("*" if isinstance(p, int) else p for p in path[1:])
    return len(path) > 1 and rest in _TEXT_PATHS


def _check_string(text: str, name: str, path: tuple[Any, ...], limit: int, what: str = "") -> None:
    if len(text) > limit:
        raise APIError(400, f"{what}{_where(name, path)} has {len(text)} characters; at most {limit} are accepted "
                            "(router.max_string_chars)", name)


def _where(name: str, path: tuple[Any, ...]) -> str:
    """messages[2].tool_calls[0].function.name"""
    return name + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
