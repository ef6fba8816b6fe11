"""Tool-call parsers for tool_choice "auto": what each model format's text becomes, fed whole
and fed in pieces (the events must not depend on the split)."""

from __future__ import annotations

import json
import random

import pytest

from router.tool_parsers import TOOL_PARSERS, Content, Event, HermesParser, Llama3JsonParser, ToolCall


def run(parser_name: str, pieces: list[str]) -> list[Event]:
    parser = TOOL_PARSERS[parser_name]()
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def merged(events: list[Event]) -> list[Event]:
    """Adjacent content events joined: how they split is the parser's business."""
    out: list[Event] = []
    for event in events:
        if isinstance(event, Content) and out and isinstance(out[-1], Content):
            out[-1] = Content(out[-1].text + event.text)
        elif not (isinstance(event, Content) and not event.text):
            out.append(event)
    return out


def parse(parser_name: str, text: str) -> list[Event]:
    """The events for `text` fed whole; checked equal when fed char by char and in random
    pieces."""
    whole = merged(run(parser_name, [text]))
    assert merged(run(parser_name, list(text))) == whole
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert merged(run(parser_name, pieces)) == whole, pieces
    return whole


def call(name: str, arguments: dict, raw: str) -> ToolCall:
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False), raw)


def test_registry_names_the_two_formats() -> None:
    assert TOOL_PARSERS["hermes"] is HermesParser and TOOL_PARSERS["llama3_json"] is Llama3JsonParser


# -- hermes

def test_hermes_content_then_two_calls_then_trailing_text() -> None:
    first = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
    second = '<tool_call>{"name": "get_time", "arguments": {"tz": "日本"}}</tool_call>'
    text = f"Let me look.\n{first}\n{second}\nDone 🙂"
    assert parse("hermes", text) == [
        Content("Let me look.\n"), call("get_weather", {"city": "Zürich"}, first), Content("\n"),
        call("get_time", {"tz": "日本"}, second), Content("\nDone 🙂")]


def test_hermes_streams_content_at_once_and_holds_only_a_possible_tag() -> None:
    parser = HermesParser()
    assert parser.feed("Hello <tool") == [Content("Hello ")]
    assert parser.feed("s> and <tool_") == [Content("<tools> and ")]
    assert parser.feed('call>{"name": "f", ') == []  # inside a block: held
    assert parser.feed('"arguments": {}}</tool_call>x') == [
        ToolCall("f", "{}", '<tool_call>{"name": "f", "arguments": {}}</tool_call>'), Content("x")]
    assert parser.feed("<") == []
    assert parser.finish() == [Content("<")]


def test_hermes_unterminated_block_is_content() -> None:
    text = 'Hi <tool_call>{"name": "f", "arguments": {"a": 1}}'
    assert parse("hermes", text) == [Content(text)]
    assert parse("hermes", "Hi <tool_call>") == [Content("Hi <tool_call>")]
    cut = 'Hi <tool_call>{"name": "f", "arguments": {"a": "x</tool_'
    assert parse("hermes", cut) == [Content(cut)]


def test_hermes_bad_json_is_content_and_later_calls_still_parse() -> None:
    bad = '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>'  # a brace missing
    good = '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert parse("hermes", bad + good) == [Content(bad), ToolCall("g", "{}", good)]
    for block in ['<tool_call>not json</tool_call>', '<tool_call>{"name": "f"} trailing</tool_call>',
                  '<tool_call>{"name": f}</tool_call>',
                  '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>']:
        assert parse("hermes", block + good) == [Content(block), ToolCall("g", "{}", good)], block


def test_hermes_call_without_a_string_name_is_content() -> None:
    for body in ['{"arguments": {}}', '{"name": 3, "arguments": {}}', '{"name": "", "arguments": {}}',
                 '["f", {}]', '{"name": "f", "arguments": [1]}']:
        block = f"<tool_call>{body}</tool_call>"
        assert parse("hermes", block) == [Content(block)], body


def test_hermes_nested_braces_and_a_close_tag_inside_a_string() -> None:
    args = {"query": 'a } and </tool_call> and "quoted" \\ {', "filter": {"deep": [{"x": "]"}]}}
    block = f"<tool_call>{json.dumps({'name': 'search', 'arguments': args})}</tool_call>"
    assert parse("hermes", block + " after") == [call("search", args, block), Content(" after")]


def test_hermes_arguments_may_be_a_json_string_or_missing() -> None:
    block = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert parse("hermes", block) == [ToolCall("f", '{"a": 1}', block)]
    bare = '<tool_call>{"name": "f"}</tool_call>'
    assert parse("hermes", bare) == [ToolCall("f", "{}", bare)]


def test_hermes_plain_text_passes_through() -> None:
    text = "No tools needed: 2 < 3 and a <tool> tag.\n"
    assert parse("hermes", text) == [Content(text)]


# -- llama3_json

def test_llama3_python_tag_and_semicolon_separated_calls() -> None:
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    two = '{"name": "get_time", "parameters": {"tz": "UTC"}}'
    assert parse("llama3_json", f"<|python_tag|>{one}; {two}") == [
        call("get_weather", {"city": "Paris"}, one), call("get_time", {"tz": "UTC"}, two)]
    assert parse("llama3_json", f"  {one};{two}\n") == [
        call("get_weather", {"city": "Paris"}, one), call("get_time", {"tz": "UTC"}, two)]


def test_llama3_arguments_alias() -> None:
    one = '{"name": "f", "arguments": {"a": [1, {"b": "}"}]}}'
    assert parse("llama3_json", one) == [call("f", {"a": [1, {"b": "}"}]}, one)]


def test_llama3_plain_content() -> None:
    for text in ["The weather is {fine}.", "  Hello", "<|python_", "<|python_tag|>print('hi')", "   "]:
        assert parse("llama3_json", text) == [Content(text)], text


def test_llama3_plain_content_streams_once_decided() -> None:
    parser = Llama3JsonParser()
    assert parser.feed("  ") == []  # could still be a call
    assert parser.feed("Sure") == [Content("  Sure")]
    assert parser.feed(" {x}") == [Content(" {x}")]
    assert parser.finish() == []


def test_llama3_cut_short_and_not_a_call_are_content() -> None:
    cut = '<|python_tag|>{"name": "f", "parameters": {"a": '
    assert parse("llama3_json", cut) == [Content(cut)]
    one = '{"name": "f", "parameters": {}}'
    assert parse("llama3_json", one + '; {"name": "g", "param') == [ToolCall("f", "{}", one),
                                                                    Content('{"name": "g", "param')]
    assert parse("llama3_json", '{"city": "Paris"}') == [Content('{"city": "Paris"}')]
    assert parse("llama3_json", one + " is what I would call.") == [ToolCall("f", "{}", one),
                                                                     Content(" is what I would call.")]


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_no_text_no_events(name: str) -> None:
    assert run(name, []) == [] and run(name, [""]) == []
