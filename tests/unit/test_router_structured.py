"""router/structured.py: what a body's constraint fields become (no HTTP, no engine)."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from engine.structured.grammar import build_grammar
from engine.structured.params import StructuredOutputsParams as P
from router import structured
from router.errors import APIError

PLACE = {"$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                             "required": ["city"]}},
         "type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}, "days": {"type": "integer"}},
         "required": ["where", "days"]}
TREE = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 4},
                                         "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
        "required": ["label"]}


def _tools(*schemas: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": s}} for i, s in enumerate(schemas)]


def _accepts(spec: P, text: str) -> bool:
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(build_grammar(spec)),
                                 terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_completed()


def _constraint(body: dict) -> structured.Constraint:
    return structured.constraint(body, structured.tool_choice(body))


def test_required_calls_keep_each_tools_local_references() -> None:
    """Pydantic-style $defs and recursive "#" references resolve inside the calls array."""
    body = {"tools": _tools(PLACE, TREE, {"type": "object"}), "tool_choice": "required"}
    spec = _constraint(body).params
    call = json.dumps([{"name": "f0", "parameters": {"where": {"city": "Paris"}, "days": 3}},
                       {"name": "f1", "parameters": {"label": "a", "kids": [{"label": "b"}]}}])
    assert _accepts(spec, call)
    assert not _accepts(spec, json.dumps([{"name": "f0", "parameters": {"where": {"town": "x"}, "days": 3}}]))
    assert not _accepts(spec, json.dumps([{"name": "f1", "parameters": {"label": "a", "kids": [{"x": 1}]}}]))
    assert not _accepts(spec, "[]")
    named = _constraint({**body, "tool_choice": {"type": "function", "function": {"name": "f0"}}}).params
    assert _accepts(named, json.dumps({"where": {"city": "Rome"}, "days": 1}))


def test_without_parallel_calls_required_allows_one_call() -> None:
    spec = _constraint({"tools": _tools({"type": "object"}), "tool_choice": "required",
                        "parallel_tool_calls": False}).params
    assert _accepts(spec, '[{"name": "f0", "parameters": {}}]')
    assert not _accepts(spec, '[{"name": "f0", "parameters": {}}, {"name": "f0", "parameters": {}}]')


@pytest.mark.parametrize("body, param, message", [
    ({"tools": [{"type": "function", "function": {"name": "get_weather\n"}}]}, "tools",
     "tools[0].function.name must be 1-64 letters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x\n", "schema": {}}}}, "response_format",
     "response_format.json_schema.name must be"),
    ({"structured_outputs": {"json": 0}}, "structured_outputs", "structured_outputs.json must be an object"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs", "structured_outputs.regex must be a non-empty"),
    ({"tools": _tools({}), "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "response_format and tools both constrain the output"),
    ({"tools": _tools({}) * 2}, "tools", "tools[1].function.name 'f0' is defined twice"),
    ({"tools": _tools({}), "tool_choice": "sometimes"}, "tool_choice", 'tool_choice must be "none", "auto"'),
    ({"tools": _tools({}), "parallel_tool_calls": 1}, "parallel_tool_calls", "must be a boolean"),
])
def test_bad_constraints_name_their_field(body: dict, param: str, message: str) -> None:
    with pytest.raises(APIError) as err:
        _constraint(body)
    assert err.value.status == 400 and err.value.param == param and message in err.value.message


def test_a_worker_error_is_said_with_the_clients_field() -> None:
    exc = APIError(400, "structured_outputs.json cannot be compiled: Unsupported type \"foo\"", "structured_outputs.json")
    named = structured.worker_error(exc, "response_format.json_schema.schema")
    assert named.param == "response_format"
    assert named.message == 'response_format.json_schema.schema cannot be compiled: Unsupported type "foo"'
    assert structured.worker_error(exc, None) is exc
