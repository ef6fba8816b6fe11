"""Structured outputs and tool calls over real HTTP through remote prefill (issue 17):
the demo model (SmolLM2-135M-Instruct, float32) behind the router, one prefill worker
and one decode worker, every prompt prefilled by the prefill worker. Sampled outputs
validate against their constraint; tool calls validate against their tool's schema,
streamed and not, and through the official `openai` client; a constraint the decode
worker cannot compile is a 400 naming the client's field; a constraint that allows
the model's own greedy text changes nothing."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx2 as httpx
import jsonschema
import openai
import pytest

from cluster.config import ClusterConfig
from cluster.demo_model import DEMO_MODELS, default_models_dir
from cluster.serve import build
from tests.disagg.test_tp_serving import status
from tests.http_server import free_port, serving

MODEL_DIR = default_models_dir() / DEMO_MODELS["smollm2"].dir_name

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(),
                                reason="demo model not prepared (make model)")

SAMPLES = 12  # sampled requests per constraint kind
# At least this share of each kind's samples must end by the grammar ("stop"), not by max_tokens.
MIN_STOPPED = 0.8
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


def shots(*turns: str) -> list[dict[str, str]]:
    """Alternating user / assistant messages, ending with the user's: a few examples
    keep a 135M model's sampled answers short enough to finish."""
    return [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
    "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                              "lat": {"type": "number", "minimum": -90, "maximum": 90}},
             "required": ["city", "lat"], "additionalProperties": False}},
    "required": ["name", "age", "role", "tags", "home"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,3}(, [A-Z][a-z]{2,8} [0-9]{1,3}){0,2}\."
CHOICES = ["yes", "yes, mostly", "no", "not sure"]
ARITHMETIC = '\n'.join([
    'root ::= expr',
    'expr ::= term (op term)*',
    'op ::= " + " | " - " | " * "',
    'term ::= number | "(" expr ")"',
    'number ::= "0" | [1-9] [0-9]? [0-9]?'])


def arithmetic(text: str) -> bool:
    """ARITHMETIC, by recursive descent: does it match the whole text?"""
    number = re.compile(r"0|[1-9][0-9]{0,2}")

    def expr(i: int) -> int:
        i = term(i)
        while i >= 0 and text[i:i + 3] in (" + ", " - ", " * "):
            i = term(i + 3)
        return i

    def term(i: int) -> int:
        if text[i:i + 1] == "(":
            i = expr(i + 1)
            return i + 1 if i >= 0 and text[i:i + 1] == ")" else -1
        found = number.match(text, i)
        return found.end() if found else -1

    return expr(0) == len(text)


def _is_dict(text: str) -> None:
    assert isinstance(json.loads(text), dict)


# kind -> (messages, the body's constraint fields, max_tokens, the check of a "stop" output)
KINDS: dict[str, tuple[list[dict[str, str]], dict[str, Any], int, Any]] = {
    "json_schema": (
        shots("A person, as JSON.", '{"name": "Ann", "age": 30, "role": "user", "tags": ["a"], '
                                    '"home": {"city": "Oslo", "lat": 59.9}}',
              "Another person, as JSON."),
        {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}, 64,
        lambda text: jsonschema.validate(json.loads(text), PERSON)),
    "json_object": (
        shots("Capital of Italy? Answer in JSON.", '{"capital": "Rome"}',
              "Capital of Spain? Answer in JSON.", '{"capital": "Madrid"}',
              "Capital of France? Answer in JSON."),
        {"response_format": {"type": "json_object"}}, 40, _is_dict),
    "regex": (
        shots("Name up to three cities with a number each, like: Paris 3, Rome 12."),
        {"structured_outputs": {"regex": REGEX}}, 48,
        lambda text: re.fullmatch(REGEX, text) or pytest.fail(f"{text!r} does not match {REGEX}")),
    "choice": (
        shots("Is Paris in France?"),
        {"structured_outputs": {"choice": CHOICES}}, 8,
        lambda text: text in CHOICES or pytest.fail(f"{text!r} is not one of {CHOICES}")),
    "grammar": (
        shots("Write a short arithmetic expression, like (2 + 3) * 4."),
        {"structured_outputs": {"grammar": ARITHMETIC}}, 40,
        lambda text: arithmetic(text) or pytest.fail(f"{text!r} is not in the ARITHMETIC grammar")),
}

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_MAX_TOKENS = 80


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    # remote_prefill_min_tokens 4: every chat prompt goes to the prefill worker, with room
    # for a kind's sampled requests at once (none prefilled locally for want of a slot,
    # or because its KV came too late); long health and transfer limits: a step of a full
    # batch on a loaded 2-core machine is slow, not dead.
    config = ClusterConfig.from_dict({
        "model": str(MODEL_DIR), "dtype": "float32", "transport": "shm", "prefill_deadline_s": 300.0,
        "transport_options": {"timeout_s": 120.0},
        "router": {"port": free_port(), "remote_prefill_min_tokens": 4, "max_queued_requests": 512,
                   "prefill_max_outstanding": 512, "worker_timeout_s": 60.0, "stall_timeout_s": 120.0},
        "prefill": {"replicas": 1, "engine": {"num_kv_blocks": 512, "num_threads": 1}},
        "decode": {"replicas": 1, "engine": {"num_kv_blocks": 1024, "num_threads": 1, "max_num_seqs": 64}}})
    workers, router = build(config)
    try:
        with serving(router, config.router.port) as url:
            yield url
    finally:
        workers.stop()


def chat(base: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", json={"model": str(MODEL_DIR), **body}, timeout=400)


def chat_all(base: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The answers to all `bodies`, sent at once (each must be a 200)."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda body: chat(base, body), bodies))
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json() for r in responses]


def prefills(base: str) -> tuple[int, int]:
    """The decode worker's prompts so far: (prefilled remotely, prefilled locally)."""
    stats = [w["stats"] for w in status(base)["decode_workers"]]
    return sum(s["remote"] for s in stats), sum(s["local"] for s in stats)


def streamed_message(base: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """A streamed chat answer's deltas joined as a client would: (message, finish_reason)."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    reason = None
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={"model": str(MODEL_DIR), **body, "stream": True},
                      timeout=240) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta, reason = choice["delta"], choice["finish_reason"] or reason
            content.append(delta.get("content") or "")
            for d in delta.get("tool_calls") or []:
                if d["index"] not in calls:
                    calls[d["index"]] = {"id": d["id"], "type": d["type"],
                                         "function": {"name": d["function"]["name"], "arguments": ""}}
                calls[d["index"]]["function"]["arguments"] += d["function"].get("arguments") or ""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, reason


def check_tool_calls(message: dict[str, Any], names: set[str]) -> None:
    """Every call has an OpenAI id, names one of `names`, and its arguments validate."""
    assert message["content"] is None and message["tool_calls"]
    for call in message["tool_calls"]:
        assert CALL_ID.match(call["id"]) and call["type"] == "function"
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    """Call ids are drawn per response: two answers compare without them."""
    return {**message, "tool_calls": [{**c, "id": None} for c in message.get("tool_calls", [])]}


def tagged(messages: list[dict[str, str]], seed: int) -> list[dict[str, str]]:
    """The messages with the last one numbered: the prompts of a kind share all but their
    last block, so the decode worker's prefix cache never holds a whole prompt (which it
    would prefill itself rather than remotely) and the prefill worker computes little."""
    return messages[:-1] + [{**messages[-1], "content": f"{messages[-1]['content']} ({seed})"}]


@pytest.fixture(scope="module")
def sampled(base: str) -> dict[str, list[dict[str, Any]]]:
    """SAMPLES seeded temperature-1 answers per kind (a kind's sent at once); and checks
    that every one was prefilled by the prefill worker."""
    before = prefills(base)
    answers = {kind: chat_all(base, [{"messages": tagged(messages, seed), **fields, "max_tokens": max_tokens,
                                      "temperature": 1.0, "seed": seed} for seed in range(SAMPLES)])
               for kind, (messages, fields, max_tokens, _) in KINDS.items()}
    remote, local = (a - b for a, b in zip(prefills(base), before))
    assert (remote, local) == (len(KINDS) * SAMPLES, 0)
    return answers


@pytest.mark.timeout(500)
@pytest.mark.parametrize("kind", list(KINDS))
def test_sampled_outputs_validate_through_remote_prefill(sampled, kind: str) -> None:
    check = KINDS[kind][3]
    choices = [a["choices"][0] for a in sampled[kind]]
    stopped = [c["message"]["content"] for c in choices if c["finish_reason"] == "stop"]
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)
    assert len(stopped) >= MIN_STOPPED * SAMPLES, f"only {len(stopped)} of {SAMPLES} ended by their grammar"
    for text in stopped:
        check(text)


def test_the_arithmetic_checker() -> None:
    assert arithmetic("(2 + 3) * 40") and arithmetic("0") and arithmetic("((1))")
    assert not any(map(arithmetic, ["(2 + 3", "2 +", "01", "1000", "2+3", ""]))


@pytest.mark.timeout(120)
def test_json_object_is_an_object_when_the_model_would_write_an_array(base: str) -> None:
    """S1 (found by the schedule fuzzer): json_object once admitted a JSON array."""
    messages = shots("Two colors, as JSON.", '["red", "green"]', "Two fruits, as JSON.", '["apple", "pear"]',
                     "Two animals, as JSON.")
    plain = chat(base, {"messages": messages, "max_tokens": 20, "temperature": 0.0})
    assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"].startswith("[")
    r = chat(base, {"messages": messages, "max_tokens": 20, "temperature": 0.0,
                    "response_format": {"type": "json_object"}})
    assert r.status_code == 200
    text = r.json()["choices"][0]["message"]["content"]
    assert text.lstrip().startswith("{"), f"json_object gave {text!r}"


@pytest.mark.timeout(300)
def test_required_and_named_tool_calls_validate(base: str) -> None:
    # tool_choice, parallel_tool_calls: a named function is one call either way.
    cases = [("required", True), ("required", False), (NAMED, True)]
    bodies = [{"messages": ASK, "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel,
               "max_tokens": TOOL_MAX_TOKENS, "temperature": 1.0, "seed": seed}
              for choice, parallel in cases for seed in range(6)]
    for body, answer in zip(bodies, chat_all(base, bodies)):
        choice = answer["choices"][0]
        named = body["tool_choice"] == NAMED
        check_tool_calls(choice["message"], {"get_weather"} if named else set(SCHEMAS))
        if named or not body["parallel_tool_calls"]:
            assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1, choice
        else:  # calls may go on until max_tokens; the cut one is dropped
            assert choice["finish_reason"] in ("tool_calls", "length")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("choice,parallel,temperature", [("required", False, 0.0), ("required", True, 1.0),
                                                         (NAMED, True, 1.0)])
def test_streamed_tool_call_deltas_join_to_the_answer(base: str, choice: Any, parallel: bool,
                                                      temperature: float) -> None:
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel,
            "max_tokens": TOOL_MAX_TOKENS, "temperature": temperature, "seed": 3}
    r = chat(base, body)
    assert r.status_code == 200
    answer = r.json()["choices"][0]
    message, reason = streamed_message(base, body)
    check_tool_calls(message, set(SCHEMAS))
    assert reason == answer["finish_reason"] and without_ids(message) == without_ids(answer["message"])
    if not parallel:
        assert reason == "tool_calls"


@pytest.mark.timeout(120)
def test_a_history_with_tool_calls_and_results_is_rendered(base: str) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    usage = []
    for messages in (history, ASK):
        r = chat(base, {"messages": messages, "tools": TOOLS, "max_tokens": 4, "temperature": 0.0})
        assert r.status_code == 200, r.text
        usage.append(r.json()["usage"]["prompt_tokens"])
    assert usage[0] > usage[1]


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=240, max_retries=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_openai_client_tools(client: openai.OpenAI, tool_choice: Any) -> None:
    kwargs = dict(model=str(MODEL_DIR), messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
                  max_tokens=TOOL_MAX_TOKENS, temperature=1.0, seed=3)
    out = client.chat.completions.create(**kwargs)
    assert out.choices[0].finish_reason == "tool_calls"
    message = out.choices[0].message.model_dump(exclude_none=True)
    check_tool_calls({"content": None, **message}, set(SCHEMAS))
    # Accumulated as the SDK's docs show: the first delta of a call holds it, later
    # ones add argument fragments.
    final: dict[int, Any] = {}
    reason = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        reason = chunk.choices[0].finish_reason or reason
        for call in chunk.choices[0].delta.tool_calls or []:
            if call.index not in final:
                final[call.index] = call
            else:
                final[call.index].function.arguments += call.function.arguments
    assert reason == "tool_calls"
    streamed = [(c.function.name, c.function.arguments) for _, c in sorted(final.items())]
    assert streamed == [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls]
    assert all(CALL_ID.match(c.id) for c in final.values())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_openai_client_response_format(client: openai.OpenAI, kind: str) -> None:
    messages, fields, max_tokens, check = KINDS[kind]
    kwargs = dict(model=str(MODEL_DIR), messages=messages, response_format=fields["response_format"],
                  max_tokens=max_tokens, temperature=1.0, seed=1)
    out = client.chat.completions.create(**kwargs)
    assert out.choices[0].finish_reason == "stop"
    check(out.choices[0].message.content)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True))
    assert text == out.choices[0].message.content


GOOD = {"messages": ASK, "max_tokens": 4}
BAD = {
    "uncompilable schema": ({"response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
                            "response_format"),
    "invalid regex": ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    "invalid EBNF": ({"structured_outputs": {"grammar": 'root ::= "a" undefined_rule'}}, "structured_outputs"),
    "unknown tool_choice": ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                            "tool_choice"),
    "undefined tool in the history": (
        {"tools": TOOLS, "messages": ASK + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "nope", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "done"}]},
        "messages"),
}

# Refused by the decode worker, once the request was admitted (its grammar compiled there).
FOUND_BY_THE_WORKER = {"uncompilable schema", "invalid regex", "invalid EBNF"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_constraint_is_a_400_naming_its_field(base: str, case: str, stream: bool) -> None:
    fields, param = BAD[case]
    body = {"model": str(MODEL_DIR), **GOOD, **fields, "stream": stream}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as response:
        text = response.read().decode()
    if stream and case in FOUND_BY_THE_WORKER:
        # A stream's headers went out at its admission: the decode worker's refusal is
        # its one event, an error, then [DONE] (no choice before it).
        assert response.status_code == 200, text
        events = [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]
        assert len(events) == 2 and events[1] == "[DONE]", text
        text = events[0]
    else:  # found by the router: the response's status, no event before it
        assert response.status_code == 400, text
    error = json.loads(text)["error"]
    assert error["code"] is None  # OpenAI's: a string or null; the type says it is the request's fault
    assert error["param"] == param and error["type"] == "invalid_request_error"
    r = chat(base, GOOD)  # and the server keeps serving
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.timeout(120)
def test_a_choice_of_the_models_own_greedy_text_leaves_it_unchanged(base: str) -> None:
    messages = ASK
    plain = chat(base, {"messages": messages, "max_tokens": 8, "temperature": 0.0}).json()["choices"][0]
    text = plain["message"]["content"]
    assert plain["finish_reason"] == "length" and len(text) > 6
    # Another choice shares a prefix with it, so the grammar does constrain the way.
    choice = {"structured_outputs": {"choice": [text[:4] + " banana", text, "London"]}}
    for max_tokens, reason in ((8, "length"), (9, "stop")):  # the 9th token can only end the choice
        out = chat(base, {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, **choice})
        assert out.status_code == 200
        assert (out.json()["choices"][0]["message"]["content"], out.json()["choices"][0]["finish_reason"]) \
            == (text, reason)
