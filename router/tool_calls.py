"""Generated text -> an OpenAI chat answer with `tool_calls`, streamed or not.

One ToolCallStream per request. The router feeds it each new piece of generated text and
sends the chat-completion-chunk `delta` dicts it returns; at the end, finish() gives the
last deltas and the finish_reason, and message() the non-streamed message. Invariant: the
streamed deltas and message() come from the same state, so joining the deltas (content
strings; per call index, the header's name and the argument fragments) gives message()
exactly, however the text was split.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal

from router.tool_parsers import JSON_DECODER, TOOL_PARSERS, Content, JsonEnd, ToolCall, call_from_object, skip_space

Mode = Literal["named", "required", "auto"]
MODES = ("named", "required", "auto")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class _Call:
    id: str
    name: str
    arguments: str


class ToolCallStream:
    """How the generated text reads, by `mode`:
    - "named": the whole text is the arguments JSON of `function_name`; it streams through
      as argument fragments (the grammar made it valid, unless cut short).
    - "required": the text is a JSON array `[{"name": ..., "parameters": {...}}, ...]` (valid
      by grammar unless cut short); each call is sent once its element is complete. An
      element that is not a call of a defined tool (grammar-made text has none) ends the calls.
    - "auto": the model's own format, read by TOOL_PARSERS[parser]. A call naming a tool not
      in `tool_names` is content, verbatim. The content is the text around the calls, less
      the whitespace that would begin or end it when there are calls.
    Without `parallel_tool_calls`, only the first call is kept (auto and required)."""

    def __init__(self, mode: Mode, tool_names: Collection[str] = (), *, parallel_tool_calls: bool = True,
                 function_name: str | None = None, parser: str | None = None,
                 new_id: Callable[[], str] = new_call_id) -> None:
        if mode not in MODES:
            raise ValueError(f"tool call mode must be one of {MODES}, got {mode!r}")
        if mode == "named" and not function_name:
            raise ValueError("tool call mode 'named' needs function_name")
        if mode == "auto" and parser not in TOOL_PARSERS:
            raise ValueError(f"tool parser must be one of {sorted(TOOL_PARSERS)}, got {parser!r}")
        self.mode = mode
        self._tool_names = frozenset(tool_names)
        self._parallel = parallel_tool_calls
        self._function_name = function_name
        self._new_id = new_id
        self._content: list[str] = []
        self._calls: list[_Call] = []
        self._finished = False
        # auto
        self._parser = TOOL_PARSERS[parser]() if mode == "auto" and parser is not None else None
        self._held_space = ""  # whitespace at the end of the content so far, not yet sent
        # required
        self._text = ""
        self._pos = 0
        self._expect: Literal["[", "first", "next", "element", "done", "broken"] = "["
        self._element: JsonEnd | None = None

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas to send for this new piece of generated text (possibly none)."""
        if self._finished:
            raise RuntimeError("ToolCallStream.feed after finish")
        deltas: list[dict[str, Any]] = []
        if self.mode == "named":
            if text:
                if not self._calls:
                    self._header(deltas, self._function_name or "")
                self._arguments(deltas, text)
        elif self.mode == "required":
            self._text += text
            self._read_array(deltas)
        else:
            assert self._parser is not None
            self._auto(deltas, self._parser.feed(text))
        return deltas

    def finish(self, finish_reason: str) -> tuple[list[dict[str, Any]], str]:
        """The last deltas, and the finish_reason to report: "tool_calls" for a normal end
        ("stop") with a call; any other reason as it is."""
        if self._finished:
            raise RuntimeError("ToolCallStream.finish called twice")
        self._finished = True
        deltas: list[dict[str, Any]] = []
        if self.mode == "named":
            if not self._calls:  # nothing generated: the call is still the answer
                self._header(deltas, self._function_name or "")
        elif self.mode == "required":
            if not self._calls and self._text:  # no complete element: show what came
                self._send_content(deltas, self._text)
        else:
            assert self._parser is not None
            self._auto(deltas, self._parser.finish())
            if not self._calls:  # plain text keeps its trailing whitespace
                self._send_content(deltas, self._held_space)
        reason = "tool_calls" if self._calls and finish_reason == "stop" else finish_reason
        return deltas, reason

    def message(self) -> dict[str, Any]:
        """The non-streamed assistant message, after finish()."""
        content = "".join(self._content)
        if not self._calls:
            return {"role": "assistant", "content": content}
        return {"role": "assistant", "content": content or None,
                "tool_calls": [{"id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": call.arguments}}
                               for call in self._calls]}

    # -- deltas, and the state message() reads

    def _send_content(self, deltas: list[dict[str, Any]], text: str) -> None:
        if not text:
            return
        self._content.append(text)
        if deltas and set(deltas[-1]) == {"content"}:
            deltas[-1] = {"content": deltas[-1]["content"] + text}
        else:
            deltas.append({"content": text})

    def _header(self, deltas: list[dict[str, Any]], name: str) -> None:
        call = _Call(self._new_id(), name, "")
        self._calls.append(call)
        deltas.append({"tool_calls": [{"index": len(self._calls) - 1, "id": call.id, "type": "function",
                                       "function": {"name": name, "arguments": ""}}]})

    def _arguments(self, deltas: list[dict[str, Any]], fragment: str) -> None:
        self._calls[-1].arguments += fragment
        deltas.append({"tool_calls": [{"index": len(self._calls) - 1, "function": {"arguments": fragment}}]})

    def _call(self, deltas: list[dict[str, Any]], name: str, arguments: str) -> None:
        if self._calls and not self._parallel:
            return
        self._header(deltas, name)
        self._arguments(deltas, arguments)

    # -- auto

    def _auto(self, deltas: list[dict[str, Any]], events: list[Content | ToolCall]) -> None:
        for event in events:
            if isinstance(event, ToolCall) and event.name in self._tool_names:
                self._call(deltas, event.name, event.arguments)
                continue
            text = self._held_space + (event.text if isinstance(event, Content) else event.raw)
            if self._calls and not self._content:
                text = text.lstrip()
            body = text.rstrip()
            self._held_space = text[len(body):]
            self._send_content(deltas, body)

    # -- required

    def _read_array(self, deltas: list[dict[str, Any]]) -> None:
        """Advance over `[elem, elem, ...]` as far as the text allows; grammar-made text
        follows this shape, and anything else stops the reading ("broken")."""
        text = self._text
        while self._expect not in ("done", "broken"):
            if self._element is None:
                at = skip_space(text, self._pos)
                if at == len(text):
                    return
                char = text[at]
                self._pos = at + 1
                if self._expect == "[":
                    self._expect = "first" if char == "[" else "broken"
                elif char == "]" and self._expect in ("first", "next"):
                    self._expect = "done"
                elif self._expect == "next":
                    self._expect = "element" if char == "," else "broken"
                elif char == "{":
                    self._element = JsonEnd(at)
                else:
                    self._expect = "broken"
                continue
            kind, end = self._element.run(text)
            if kind != "end":
                return
            start, self._element = self._element.start, None
            self._pos, self._expect = end, "next"
            try:
                value, _ = JSON_DECODER.raw_decode(text, start)
            except ValueError:
                self._expect = "broken"
                return
            call = call_from_object(value, text[start:end])
            if call is None or (self._tool_names and call.name not in self._tool_names):
                self._expect = "broken"
                return
            self._call(deltas, call.name, call.arguments)
