"""Generated text -> OpenAI tool_calls: the deltas a stream sends, the finish_reason, the
non-streamed message, and that joining the deltas gives that message however the text is
split (every single split point, and 200 seeded random splittings per case)."""

from __future__ import annotations

import itertools
import json
import random
import re
from typing import Any

import pytest

from router.tool_calls import ToolCallStream, new_call_id

TOOLS = {"get_weather", "get_time"}
ID = re.compile(r"call_[0-9a-f]{24}")


def ids() -> Any:
    counter = itertools.count()
    return lambda: f"call_{next(counter):024x}"


def make(mode: str, **kw: Any) -> ToolCallStream:
    kw.setdefault("new_id", ids())
    return ToolCallStream(mode, kw.pop("tool_names", TOOLS), **kw)  # type: ignore[arg-type]  # modes as strings


def assemble(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client builds from the deltas, checking each is shaped as OpenAI streams them."""
    content, calls = "", {}
    for delta in deltas:
        assert set(delta) in ({"content"}, {"tool_calls"}), delta
        if "content" in delta:
            assert isinstance(delta["content"], str) and delta["content"], delta
            content += delta["content"]
            continue
        (item,) = delta["tool_calls"]
        index = item["index"]
        if "id" in item:  # a call's first delta
            assert set(item) == {"index", "id", "type", "function"} and item["type"] == "function"
            assert ID.fullmatch(item["id"]) and item["function"]["arguments"] == ""
            assert index == len(calls), "calls are numbered 0, 1, ... in order"
            calls[index] = {"id": item["id"], "type": "function",
                            "function": {"name": item["function"]["name"], "arguments": ""}}
        else:
            assert set(item) == {"index", "function"} and set(item["function"]) == {"arguments"}
            calls[index]["function"]["arguments"] += item["function"]["arguments"]
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["content"] = content or None
        message["tool_calls"] = [calls[i] for i in range(len(calls))]
    return message


def stream(stream_: ToolCallStream, pieces: list[str], reason: str = "stop") -> tuple[list[dict], str]:
    deltas = [d for piece in pieces for d in stream_.feed(piece)]
    last, final = stream_.finish(reason)
    return deltas + last, final


def splittings(text: str, seed: int) -> list[list[str]]:
    """Every single split point, char by char, and 200 random splittings."""
    out = [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    rng = random.Random(seed)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        out.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    return out


def answer(mode: str, text: str, reason: str = "stop", **kw: Any) -> tuple[dict[str, Any], str]:
    """The message and finish_reason for `text`, checked to be the same for every splitting
    and equal to what the streamed deltas join to."""
    results = set()
    for pieces in splittings(text, seed=len(text)):
        tc = make(mode, **kw)
        deltas, final = stream(tc, pieces, reason)
        message = tc.message()
        assert assemble(deltas) == message, pieces
        results.add((json.dumps(message, ensure_ascii=False), final))
    assert len(results) == 1, results
    message_json, final = results.pop()
    return json.loads(message_json), final


def tool_call(index: int, name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{index:024x}", "type": "function", "function": {"name": name, "arguments": arguments}}


def args(value: dict) -> str:
    return json.dumps(value, ensure_ascii=False)


# -- named

def test_named_streams_the_text_as_argument_fragments() -> None:
    tc = make("named", function_name="get_weather")
    assert tc.feed('{"city": "Zü') == [
        {"tool_calls": [{"index": 0, "id": "call_" + "0" * 24, "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Zü'}}]}]
    assert tc.feed("") == []
    assert tc.feed('rich"}') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'rich"}'}}]}]
    assert tc.finish("stop") == ([], "tool_calls")
    assert tc.message() == {"role": "assistant", "content": None,
                            "tool_calls": [tool_call(0, "get_weather", '{"city": "Zürich"}')]}


def test_named_property_and_finish_reasons() -> None:
    text = '{"city": "Zürich", "days": [1, 2], "note": "日本 🙂 \\"q\\" }"}'
    assert answer("named", text, function_name="get_weather") == (
        {"role": "assistant", "content": None, "tool_calls": [tool_call(0, "get_weather", text)]}, "tool_calls")
    cut = '{"city": "Zü'
    assert answer("named", cut, "length", function_name="get_weather") == (
        {"role": "assistant", "content": None, "tool_calls": [tool_call(0, "get_weather", cut)]}, "length")


def test_named_with_no_text_still_answers_the_call() -> None:
    tc = make("named", function_name="get_time")
    deltas, reason = stream(tc, [], "length")
    assert reason == "length" and assemble(deltas) == tc.message() == {
        "role": "assistant", "content": None, "tool_calls": [tool_call(0, "get_time", "")]}


# -- required

REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "São \\"Paulo\\" ]}", "days": [1, {"x": 2}]}},\n'
            ' {"name": "get_time", "parameters": {}}]')


def test_required_array_gives_each_call() -> None:
    assert answer("required", REQUIRED) == ({"role": "assistant", "content": None, "tool_calls": [
        tool_call(0, "get_weather", args({"city": 'São "Paulo" ]}', "days": [1, {"x": 2}]})),
        tool_call(1, "get_time", "{}")]}, "tool_calls")


def test_required_sends_a_call_as_soon_as_its_element_closes() -> None:
    tc = make("required")
    first_end = REQUIRED.index("}},") + 2
    assert tc.feed(REQUIRED[:first_end - 1]) == []
    sent = tc.feed(REQUIRED[first_end - 1:first_end])
    assert assemble(sent)["tool_calls"] == [tool_call(0, "get_weather", args(
        {"city": 'São "Paulo" ]}', "days": [1, {"x": 2}]}))]
    assert tc.feed(REQUIRED[first_end:-3]) == []


def test_required_cut_short_keeps_the_complete_calls() -> None:
    cut = REQUIRED[:REQUIRED.index('"get_time"') + 5]
    assert answer("required", cut, "length") == ({"role": "assistant", "content": None, "tool_calls": [
        tool_call(0, "get_weather", args({"city": 'São "Paulo" ]}', "days": [1, {"x": 2}]}))]}, "length")


def test_required_with_no_complete_call_shows_the_text() -> None:
    cut = '[{"name": "get_weather", "parameters": {"ci'
    assert answer("required", cut, "length") == ({"role": "assistant", "content": cut}, "length")
    assert answer("required", "[]") == ({"role": "assistant", "content": "[]"}, "stop")
    assert answer("required", " [ ] ") == ({"role": "assistant", "content": " [ ] "}, "stop")
    assert answer("required", '{"name": "get_time"}') == ({"role": "assistant", "content": '{"name": "get_time"}'},
                                                          "stop")


def test_required_element_naming_an_undefined_tool_ends_the_calls() -> None:
    unknown = '[{"name": "launch_rocket", "parameters": {}}]'
    assert answer("required", unknown) == ({"role": "assistant", "content": unknown}, "stop")
    after = REQUIRED.replace('"get_time"', '"launch_rocket"')
    assert [c["function"]["name"] for c in answer("required", after)[0]["tool_calls"]] == ["get_weather"]


def test_required_not_parallel_keeps_the_first_call() -> None:
    assert answer("required", REQUIRED, parallel_tool_calls=False) == ({"role": "assistant", "content": None,
        "tool_calls": [tool_call(0, "get_weather", args({"city": 'São "Paulo" ]}', "days": [1, {"x": 2}]}))]},
        "tool_calls")


# -- auto

HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", '
          '"q": "a } and </tool_call> \\"in\\" a string"}}\n</tool_call>\n'
          '<tool_call>{"name": "get_time", "arguments": {"tz": "日本"}}</tool_call>\nDone 🙂\n')
WEATHER = args({"city": "Zürich", "q": 'a } and </tool_call> "in" a string'})


def test_auto_hermes_content_and_calls() -> None:
    assert answer("auto", HERMES, parser="hermes") == ({"role": "assistant", "content": "Let me look.\n\n\nDone 🙂",
        "tool_calls": [tool_call(0, "get_weather", WEATHER), tool_call(1, "get_time", args({"tz": "日本"}))]},
        "tool_calls")


def test_auto_only_calls_give_no_content() -> None:
    text = HERMES[HERMES.index("<tool_call>"):HERMES.index("Done")]
    assert answer("auto", "\n" + text, parser="hermes") == ({"role": "assistant", "content": None, "tool_calls": [
        tool_call(0, "get_weather", WEATHER), tool_call(1, "get_time", args({"tz": "日本"}))]}, "tool_calls")
    # Text after the calls starts the content: the whitespace before it goes.
    message, _ = answer("auto", HERMES[HERMES.index("<tool_call>"):], parser="hermes")
    assert message["content"] == "Done 🙂" and len(message["tool_calls"]) == 2


def test_auto_plain_text_is_kept_verbatim() -> None:
    text = "\n  Hello 🙂, <tool> {no call} here.\n\n"
    for parser in ("hermes", "llama3_json"):
        assert answer("auto", text, parser=parser) == ({"role": "assistant", "content": text}, "stop")
        assert answer("auto", text, "length", parser=parser)[1] == "length"


def test_auto_unknown_tool_stays_content_verbatim() -> None:
    unknown = '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>'
    text = f"Hmm. {unknown} then <tool_call>" + '{"name": "get_time", "arguments": {}}</tool_call>'
    assert answer("auto", text, parser="hermes") == ({"role": "assistant", "content": f"Hmm. {unknown} then",
                                                      "tool_calls": [tool_call(0, "get_time", "{}")]}, "tool_calls")
    assert answer("auto", unknown, parser="hermes") == ({"role": "assistant", "content": unknown}, "stop")
    # Fed whole, the content before the known call goes out as one delta.
    assert make("auto", parser="hermes").feed(text)[0] == {"content": f"Hmm. {unknown} then"}


def test_auto_not_parallel_drops_later_calls() -> None:
    message, reason = answer("auto", HERMES, parser="hermes", parallel_tool_calls=False)
    assert message == {"role": "assistant", "content": "Let me look.\n\n\nDone 🙂",
                       "tool_calls": [tool_call(0, "get_weather", WEATHER)]}
    assert reason == "tool_calls"


def test_auto_unterminated_block_is_content() -> None:
    text = 'Checking <tool_call>{"name": "get_time", "arguments": {"tz": "U'
    assert answer("auto", text, "length", parser="hermes") == ({"role": "assistant", "content": text}, "length")


def test_auto_llama3_json() -> None:
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_time", "arguments": {}}')
    assert answer("auto", text, parser="llama3_json") == ({"role": "assistant", "content": None, "tool_calls": [
        tool_call(0, "get_weather", args({"city": "Paris"})), tool_call(1, "get_time", "{}")]}, "tool_calls")


def test_finish_reason_passes_other_reasons_through() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert answer("auto", text, "abort", parser="hermes")[1] == "abort"
    assert answer("auto", text, "length", parser="hermes")[1] == "length"
    assert answer("auto", "plain", "stop", parser="hermes")[1] == "stop"


# -- construction and ids

def test_ids_are_unique_openai_shaped() -> None:
    made = {new_call_id() for _ in range(1000)}
    assert len(made) == 1000 and all(ID.fullmatch(i) for i in made)
    tc = ToolCallStream("required", TOOLS)
    deltas, _ = stream(tc, [REQUIRED])
    first, second = (call["id"] for call in tc.message()["tool_calls"])
    assert first != second and ID.fullmatch(first) and assemble(deltas) == tc.message()


@pytest.mark.parametrize("kw, message", [
    ({"mode": "sometimes"}, "mode must be one of"),
    ({"mode": "named"}, "needs function_name"),
    ({"mode": "auto"}, "tool parser must be one of"),
    ({"mode": "auto", "parser": "mistral"}, "'mistral'"),
])
def test_bad_construction_is_refused(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ToolCallStream(kw.pop("mode"), TOOLS, **kw)


def test_feed_after_finish_is_an_error() -> None:
    tc = make("auto", parser="hermes")
    tc.finish("stop")
    with pytest.raises(RuntimeError):
        tc.feed("x")
    with pytest.raises(RuntimeError):
        tc.finish("stop")
