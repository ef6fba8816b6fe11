"""Parsers for a model's own tool-call format (tool_choice "auto"), chosen per model by name
from TOOL_PARSERS; router/tool_calls.py turns their events into OpenAI deltas.

A parser is fed the generated text piece by piece and answers what is settled so far:
content the client may see now, or a complete tool call. Invariant: the events depend only
on the text, never on how it was split into pieces, and no text is lost: every character
comes out in exactly one event (as content, or in a call's `raw`), except the separators
between llama3_json calls. Nothing here raises on what a model wrote: text that is not a
well-formed call is content.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Content:
    """Text the client may see as message content."""

    text: str


@dataclass(frozen=True)
class ToolCall:
    """A complete call. `raw` is the text it was parsed from, verbatim, so a call the request
    refuses (an undefined tool) can be shown as the content it was."""

    name: str
    arguments: str  # JSON text: OpenAI's function.arguments
    raw: str


Event = Content | ToolCall


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN/Infinity: clients' JSON parsers refuse them


JSON_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def call_from_object(obj: Any, raw: str) -> ToolCall | None:
    """The call a decoded JSON value names: {"name": str, "arguments" or "parameters": object
    or JSON string}; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, dict):
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), raw)
    if isinstance(args, str):
        return ToolCall(obj["name"], args, raw)
    return None


def parse_call(obj_text: str, raw: str) -> ToolCall | None:
    try:
        obj = JSON_DECODER.decode(obj_text)
    except ValueError:
        return None
    return call_from_object(obj, raw)


_IN_STRING = re.compile(r'["\\]')
_OUTSIDE = re.compile(r'["{}\[\]<]')
_SPACE = re.compile(r"\s*")


def skip_space(text: str, pos: int) -> int:
    match = _SPACE.match(text, pos)
    assert match is not None  # \s* matches the empty string
    return match.end()


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


ScanResult = tuple[Literal["end", "more", "stop"], int]


class JsonEnd:
    """Finds, as text arrives, where the JSON object or array starting at `start` ends.
    Brackets count only outside strings, so a `}` or a tag inside a string value does not
    end it. The text may only grow between calls to run()."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._pos = start
        self._depth = 0
        self._in_string = False
        self._end: int | None = None

    def run(self, text: str, stop: str = "") -> ScanResult:
        """("end", i): the value ends just before i. ("more", _): text ended first.
        ("stop", i): `stop` begins at i outside any string before the value closed."""
        if self._end is not None:
            return "end", self._end
        pos = self._pos
        while True:
            if self._in_string:
                match = _IN_STRING.search(text, pos)
                if match is None:
                    self._pos = len(text)
                    return "more", len(text)
                if match.group() == "\\":
                    if match.end() == len(text):  # the escaped character has not come yet
                        self._pos = match.start()
                        return "more", len(text)
                    pos = match.end() + 1
                    continue
                self._in_string = False
                pos = match.end()
                continue
            match = _OUTSIDE.search(text, pos)
            if match is None:
                self._pos = len(text)
                return "more", len(text)
            char, pos = match.group(), match.end()
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._end = pos
                    return "end", pos
            elif stop:  # "<"
                at = match.start()
                if text.startswith(stop, at):
                    self._pos = at
                    return "stop", at
                if stop.startswith(text[at:]):  # maybe the stop tag, cut by the text's end
                    self._pos = at
                    return "more", len(text)


class ToolParser(ABC):
    """One per request, used by ToolCallStream: feed() with each new piece of generated text,
    then finish() once when generation ends."""

    @abstractmethod
    def feed(self, text: str) -> list[Event]: ...

    @abstractmethod
    def finish(self) -> list[Event]: ...


def _content(events: list[Event], text: str) -> None:
    if text:
        events.append(Content(text))


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    """Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    blocks among ordinary text. Text streams out at once except a possible start of
    `<tool_call>` at the end; a block is held until its `</tool_call>`. A block whose JSON
    is not a call is content, as is one unterminated at finish()."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_block = False  # the buffer starts with HERMES_OPEN
        self._scan: JsonEnd | None = None  # the block's JSON, once its `{` has come

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while True:
            if not self._in_block:
                at = self._buf.find(HERMES_OPEN)
                if at < 0:
                    keep = len(self._buf) - partial_suffix(self._buf, HERMES_OPEN)
                    _content(events, self._buf[:keep])
                    self._buf = self._buf[keep:]
                    return events
                _content(events, self._buf[:at])
                self._buf = self._buf[at:]
                self._in_block, self._scan = True, None
            block = self._block()
            if block is None:
                return events
            end, call = block
            events.append(call if call is not None else Content(self._buf[:end]))
            self._buf = self._buf[end:]
            self._in_block = False

    def _block(self) -> tuple[int, ToolCall | None] | None:
        """The block at the buffer's start: its end (just past `</tool_call>`) and its call
        (None: the block is content), or None while it may still become either."""
        buf = self._buf
        if self._scan is None:
            at = skip_space(buf, len(HERMES_OPEN))
            if at == len(buf):
                return None
            if buf[at] != "{":
                return self._close_after(at)
            self._scan = JsonEnd(at)
        kind, at = self._scan.run(buf, stop=HERMES_CLOSE)
        if kind == "more":
            return None
        if kind == "stop":  # the JSON is broken: its `</tool_call>` came before it closed
            return at + len(HERMES_CLOSE), None
        tail = skip_space(buf, at)
        if buf.startswith(HERMES_CLOSE, tail):
            end = tail + len(HERMES_CLOSE)
            return end, parse_call(buf[self._scan.start:at], buf[:end])
        if HERMES_CLOSE.startswith(buf[tail:]):
            return None
        return self._close_after(at)  # text after the JSON: the block is content

    def _close_after(self, at: int) -> tuple[int, None] | None:
        close = self._buf.find(HERMES_CLOSE, at)
        return None if close < 0 else (close + len(HERMES_CLOSE), None)

    def finish(self) -> list[Event]:
        events: list[Event] = []
        _content(events, self._buf)  # a partial tag, or an unterminated block
        self._buf, self._in_block, self._scan = "", False, None
        return events


PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    """Llama 3.1/3.2 JSON tool calling: the whole output is `{"name": ..., "parameters":
    {...}}` objects ("arguments" accepted too), optionally after `<|python_tag|>`, several
    separated by `;`. An output not starting (after whitespace) with `{` or the tag is plain
    content, streamed as it comes; so is anything after the last object that is not another
    one. Separators between objects are not content."""

    def __init__(self) -> None:
        self._buf = ""
        self._mode: Literal["start", "json", "content"] = "start"
        self._scan: JsonEnd | None = None  # the object being read
        self._objects = 0  # objects read so far, calls or not

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while True:
            if self._mode == "content":
                _content(events, self._buf)
                self._buf = ""
                return events
            if self._scan is None:
                start = self._object_start()
                if start is None:
                    return events
                if start < 0:
                    self._mode = "content"
                    continue
                self._mode, self._scan = "json", JsonEnd(start)
            kind, end = self._scan.run(self._buf)
            if kind != "end":
                return events
            raw = self._buf[self._scan.start:end]
            events.append(parse_call(raw, raw) or Content(raw))
            self._buf, self._scan = self._buf[end:], None
            self._objects += 1

    def _object_start(self) -> int | None:
        """Where the next object's `{` is; None while the text may still lead to one;
        -1 if it does not."""
        buf = self._buf
        at = skip_space(buf, 0)
        if self._objects and buf.startswith(";", at):
            at = skip_space(buf, at + 1)
        if buf.startswith(PYTHON_TAG, at):
            at = skip_space(buf, at + len(PYTHON_TAG))
        elif PYTHON_TAG.startswith(buf[at:]):
            return None
        if at == len(buf):
            return None
        return at if buf[at] == "{" else -1

    def finish(self) -> list[Event]:
        buf, scan = self._buf, self._scan
        self._buf, self._scan = "", None
        if self._mode == "content" or self._objects == 0:
            return [Content(buf)] if buf else []  # nothing was a call: the text as it came
        if scan is not None:
            return [Content(buf[scan.start:])]  # an object cut short
        return []  # separators after the last object


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}
